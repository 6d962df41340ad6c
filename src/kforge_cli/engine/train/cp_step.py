"""The context-parallel step: the plain step on this rank's shard of every sequence.

Each CP rank keeps its load-balanced head and tail chunk of every micro-batch
(`engine.parallel.context_parallel.shard_batch`: input ids, labels, positions and document
ids together); the model gathers K/V across the CP group in attention. The step core
already counts valid tokens and sums losses over dp x cp and scales by the number of
ranks gradients are averaged over, so nothing else changes: the loss is the global mean
per valid token and `tokens_seen` counts every token once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kforge_cli.engine.parallel import shard_batch
from kforge_cli.engine.train.step import Batch, PlainStep, StepResult

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession


class ContextParallelStep(PlainStep):
    """Shard every micro-batch over the CP group, then run the plain step on the shards."""

    def __call__(self, session: TrainingSession, micro_batches: list[Batch]) -> StepResult:
        rank, size = session.runtime.cp_rank, session.runtime.cp_size
        return super().__call__(session, [shard_batch(mb, rank, size) for mb in micro_batches])
