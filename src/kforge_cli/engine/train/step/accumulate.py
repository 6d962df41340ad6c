"""The accumulating executor: every micro-batch's forward and backward in turn, then clipping.

One process, data parallelism (FSDP/HSDP), tensor and context parallelism all run here:
each micro-batch is first cut to this rank's context-parallel shard (`context_shards`),
its loss sum is scaled by the step's `TokenNormaliser` and backpropagated, and gradients
are reduced across data-parallel ranks only with the last micro-batch (`accumulate`).
Features add their gradient-only loss terms per micro-batch and act before and after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.train.step.core import (
    Batch,
    DatasetLosses,
    Executor,
    TokenNormaliser,
    accumulate,
    context_shards,
    forward_loss_sum,
)
from kforge_cli.engine.train.step.result import StepResult

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession


class AccumulateStep(Executor):
    """Token-normalised gradient accumulation over the micro-batches, with `features` composed in."""

    def __call__(self, session: TrainingSession, micro_batches: list[Batch]) -> StepResult:
        micro_batches = context_shards(session, micro_batches)
        for feature in self.features:
            feature.before_step(session, micro_batches)
        datasets = DatasetLosses.for_step(session, micro_batches)
        norm = TokenNormaliser.for_step(session, micro_batches)
        forward = self._forward(session, datasets, norm)
        total, norm = accumulate(session, micro_batches, forward, norm)
        result = self.finish(session, norm.mean(total), norm)
        if datasets is not None:
            datasets.reduce()
            result.deferred.append(datasets.means)
        return result

    def _forward(
        self, session: TrainingSession, datasets: DatasetLosses | None, norm: TokenNormaliser
    ) -> Callable[[Batch], torch.Tensor]:
        """The loss sum one micro-batch backpropagates: the LM loss plus the features' terms."""

        def base(batch: Batch) -> torch.Tensor:
            return datasets.forward(batch) if datasets is not None else forward_loss_sum(session, batch)

        if not self.features:
            return base
        counts = norm.term_counts(session)
        index = iter(range(counts.numel()))

        def with_terms(batch: Batch) -> torch.Tensor:
            loss_sum = base(batch)
            i = next(index)
            for feature in self.features:
                term = feature.loss_term(session, batch)
                if term is not None:
                    term = term * counts[i]
                    loss_sum = loss_sum + (term - term.detach()).to(loss_sum.dtype)
            return loss_sum

        return with_terms
