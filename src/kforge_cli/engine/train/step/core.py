"""The step core: what both executors share, and the features a step is composed with.

A step is an *executor* plus *features*. The executor runs one optimizer step's
forward/backward over the micro-batches: `AccumulateStep` (engine.train.step.accumulate)
loops over them with gradient accumulation; `ScheduleStep` (engine.train.step.schedule)
hands them to the pipeline schedule. Both shard every micro-batch over the
context-parallel group first (`context_shards`). A `StepFeature` adds one capability
(MoE's aux losses and balancing, the VLM freeze schedule) through a few hooks, and
delivers its gradient-only loss term the way each executor needs it: per micro-batch
(`loss_term`, added by the accumulating executor) or as per-micro-batch weights before the
schedule runs (`before_schedule`, for terms produced inside pipeline stages).

The loss is normalised by the number of valid (non-ignored) label tokens across ALL
micro-batches of the step and all ranks whose tokens differ (dp x cp:
`RuntimeContext.loss_group`, `loss_ranks`), not averaged per micro-batch, so gradient
accumulation, data and context parallelism give the same update as one big batch.
`TokenNormaliser` is that rule (count, all-reduce, scale).

Nothing here reads a tensor on the host: on a GPU every such read waits for all queued
work, so the step's numbers (token counts, loss, gradient norm) stay device scalars in
the `StepResult`, and the loop reads them (`StepResult.read`, one transfer) only on
logging steps. With fp16 the step also scales the loss by the gradient scaler's factor
(folded into the normaliser's scale) and unscales before measuring the norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.parallel import clip_grad_norm, shard_batch, vocab_parallel_loss_sum
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.session import Batch, StepFn
from kforge_cli.engine.train.step.result import StepResult

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

__all__ = ["Batch", "Executor", "StepFeature", "StepFn", "TokenNormaliser", "context_shards"]

# Batch keys passed to the model as keyword arguments when present (VLM batches add the pixels).
MODEL_INPUTS = ("doc_ids", "positions", "pixel_values", "frame_mask")


class StepFeature:
    """One capability of a step, added to either executor through these hooks (all no-ops here).

    Call order within a step: `before_step` (after context sharding, before the first
    forward) -> per micro-batch `loss_term` (accumulating executor) or once `before_schedule`
    (pipeline executor) -> `after_backward` (after the last backward, before clipping) ->
    `metrics` (merged into the step's result) -> the loop's optimizer update -> `after_update`.
    A feature may keep state across steps; `features_for` builds fresh ones per run.
    """

    def before_step(self, session: TrainingSession, micro_batches: Sequence[Batch]) -> None:
        """Runs before the first micro-batch's forward."""

    def loss_term(self, session: TrainingSession, batch: Batch) -> torch.Tensor | None:
        """A gradient-only term of this micro-batch, read right after its forward (accumulating executor).

        The executor multiplies it by the micro-batch's weight (`TokenNormaliser.term_counts`)
        and adds ``term - term.detach()`` to the loss sum, so the gradient is the term's and the
        reported loss stays the language-model loss.
        """
        return None

    def before_schedule(self, session: TrainingSession, weights: torch.Tensor) -> None:
        """The pipeline executor's counterpart of `loss_term`: ``weights[i]`` is d(step loss)/d(term)
        of micro-batch ``i``; a feature whose term arises inside the stages feeds it there."""

    def after_backward(self, session: TrainingSession) -> None:
        """Runs after the last backward, before gradients are clipped."""

    def after_update(self, session: TrainingSession) -> None:
        """Runs after the optimizer update (skipped updates included)."""

    def metrics(self) -> Mapping[str, float | torch.Tensor]:
        """Step metrics merged into `StepResult.extra` (device scalars are read only when logged)."""
        return {}


def context_shards(session: TrainingSession, micro_batches: list[Batch]) -> list[Batch]:
    """This rank's context-parallel shard of every micro-batch (unchanged without CP).

    Each CP rank keeps its load-balanced head and tail chunk of every sequence (input ids,
    labels, positions and document ids together); the model gathers K/V over the CP group
    in attention, and the normaliser counts tokens over dp x cp, so the loss is the global
    mean per valid token and `tokens_seen` counts every token once.
    """
    rank, size = session.runtime.cp_rank, session.runtime.cp_size
    return [shard_batch(mb, rank, size) for mb in micro_batches]


def loss_sum_from_output(session: TrainingSession, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss sum from a model's output: logits (vocab-sharded DTensor under loss-parallel TP),
    or already the loss sum (a scalar, when the model computed a chunked loss itself)."""
    if output.dim() == 0:
        return output
    if isinstance(output, DTensor):
        return vocab_parallel_loss_sum(output, labels, session.loss_fn.z_loss_weight)
    return session.loss_fn.from_logits(output, labels)


def model_computes_loss(session: TrainingSession) -> bool:
    """True when the model computes a chunked loss in its forward (never under TP: its
    head must run as a module, and the vocab-parallel loss already splits the logits)."""
    return session.loss_fn.chunked and session.runtime.tp_size == 1


def forward_loss_sum(session: TrainingSession, batch: Batch) -> torch.Tensor:
    """The loss summed over the valid tokens of ``batch`` (one model, no pipeline)."""
    model, loss_fn = session.model, session.loss_fn
    kwargs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    with session.autocast():
        if model_computes_loss(session):
            return model(batch["input_ids"], labels=batch["labels"], loss_fn=loss_fn, **kwargs)
        logits = model(batch["input_ids"], **kwargs)
    return loss_sum_from_output(session, logits, batch["labels"])


def forward_loss_per_token(session: TrainingSession, batch: Batch) -> torch.Tensor:
    """Per-position losses [B, T] (plain data/FSDP path only), for per-dataset losses."""
    model, loss_fn = session.model, session.loss_fn
    kwargs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    with session.autocast():
        if model_computes_loss(session):
            return model(batch["input_ids"], labels=batch["labels"], loss_fn=loss_fn.per_token, **kwargs)
        logits = model(batch["input_ids"], **kwargs)
    return loss_fn.per_token_from_logits(logits, batch["labels"])


def clip_gradients(session: TrainingSession) -> torch.Tensor:
    """Clip to train.grad_clip_norm (0 = only measure); returns the pre-clip total norm (device scalar).

    With fp16 the gradients are unscaled first, so the norm and the clip threshold are in true units.
    """
    max_norm = session.settings.train.grad_clip_norm or math.inf
    if session.grad_scaler is not None:
        session.grad_scaler.unscale_(session.optimizer)
    params = [p for p in session.model.parameters() if p.grad is not None]
    # The norm spans every mesh dim: shards (dp, tp) and pipeline stages (pp) all contribute.
    return clip_grad_norm(params, max_norm, session.runtime.pp_group())


@dataclass
class TokenNormaliser:
    """The step's global count of valid label tokens and the factor every loss sum is scaled by.

    Gradient reduction averages over the ranks FSDP shards over (dp, and cp under context
    parallelism); multiplying by their number (``loss_ranks``) undoes that, so the effective
    loss is (global loss sum) / (global valid tokens), counted over dp x cp.
    """

    n_valid: torch.Tensor  # global valid tokens (int64 scalar on the device)
    scale: torch.Tensor  # loss_ranks / n_valid (times the fp16 loss scale)
    per_micro_batch: torch.Tensor  # this rank's valid tokens of each micro-batch (int64 vector on the device)

    @classmethod
    def for_step(cls, session: TrainingSession, micro_batches: list[Batch]) -> TokenNormaliser:
        """Counted on the device (no host read; under CP after sharding, so each rank counts its part)."""
        runtime = session.runtime
        counts = torch.stack([(mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches])
        counts = counts.to(runtime.device, torch.int64)
        n_valid = all_reduce_sum(counts.sum(), runtime.loss_group())
        scale = runtime.loss_ranks / n_valid.clamp(min=1).float()
        if session.grad_scaler is not None:
            scale = session.grad_scaler.scale(scale)  # fp16: gradients scaled up so they do not underflow
        return cls(n_valid=n_valid, scale=scale, per_micro_batch=counts)

    def term_counts(self, session: TrainingSession) -> torch.Tensor:
        """The token weight of each micro-batch's gradient-only feature term (float vector on the device;
        times `scale` it is d(step loss)/d(term)).

        A term is a mean over one micro-batch's tokens on this rank (e.g. MoE's aux loss). One
        process weights it by the micro-batch's valid tokens; under context parallelism each
        rank's term covers 1/cp of every sequence, so it is weighted by the valid tokens of the
        whole sequence (summed over the CP group) over cp, which sums to the same gradient.
        """
        counts = self.per_micro_batch
        if session.runtime.cp_size > 1:
            counts = all_reduce_sum(counts.clone(), session.runtime.cp_group()).float() / session.runtime.cp_size
        return counts.float()

    def mean(self, global_loss_sum: torch.Tensor) -> torch.Tensor:
        """The step's mean loss per valid token from the global loss sum (device scalar)."""
        return global_loss_sum.double() / self.n_valid.clamp(min=1).double()


def accumulate(
    session: TrainingSession,
    micro_batches: list[Batch],
    forward: Callable[[Batch], torch.Tensor],
    norm: TokenNormaliser | None = None,
) -> tuple[torch.Tensor, TokenNormaliser]:
    """Forward/backward every micro-batch (``forward`` returns its loss sum); gradients are
    reduced across data-parallel ranks only with the last one. Returns the global loss sum."""
    norm = norm or TokenNormaliser.for_step(session, micro_batches)
    total = torch.zeros((), device=session.runtime.device, dtype=torch.float32)
    sync = getattr(session.model, "set_requires_gradient_sync", None)  # FSDP2 modules only
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        if sync is not None:
            sync(i == last)
        loss_sum = forward(batch)
        (loss_sum * norm.scale).backward()
        total += loss_sum.detach().float()
    return all_reduce_sum(total, session.runtime.loss_group()), norm


class DatasetLosses:
    """Per-dataset loss sums and token counts of a mixture, gathered while the step runs."""

    def __init__(self, session: TrainingSession, names: list[str]) -> None:
        self.session, self.names = session, names
        self.sums = torch.zeros(2, len(names), device=session.runtime.device, dtype=torch.float64)

    @classmethod
    def for_step(cls, session: TrainingSession, micro_batches: list[Batch]) -> DatasetLosses | None:
        """Tracked on the plain path (one process or FSDP) for mixtures of 2+ datasets; under TP the
        logits are vocab-sharded and under PP the loss lives on the last stage, so only the total is kept."""
        names = session.data.dataset_names
        if len(names) < 2 or session.pipeline is not None or session.runtime.tp_size > 1:
            return None
        return cls(session, names) if all("dataset_ids" in mb for mb in micro_batches) else None

    def forward(self, batch: Batch) -> torch.Tensor:
        per_token = forward_loss_per_token(self.session, batch)
        ids = batch["dataset_ids"]
        self.sums[0].index_add_(0, ids, per_token.detach().sum(dim=-1).double())
        self.sums[1].index_add_(0, ids, (batch["labels"] != IGNORE_INDEX).sum(dim=-1).double())
        return per_token.sum()

    def reduce(self) -> None:
        """Sum over the ranks (a collective: every rank, every step)."""
        all_reduce_sum(self.sums, self.session.runtime.loss_group())

    def means(self) -> dict[str, float]:
        """Per-dataset mean losses of the reduced sums (a host read: only when the step is logged)."""
        return {
            f"loss/{name}": loss_sum / tokens
            for name, loss_sum, tokens in zip(self.names, *self.sums.tolist(), strict=True)
            if tokens > 0
        }


class Executor:
    """What both executors share: the features they are composed with, and the end of a step."""

    def __init__(self, features: Sequence[StepFeature] = ()) -> None:
        self.features = tuple(features)

    def finish(self, session: TrainingSession, loss: torch.Tensor, norm: TokenNormaliser) -> StepResult:
        """After the last backward: the features' `after_backward`, clipping, and the step's result."""
        for feature in self.features:
            feature.after_backward(session)
        grad_norm = clip_gradients(session)
        extra: dict[str, float | torch.Tensor] = {}
        for feature in self.features:
            extra.update(feature.metrics())
        return StepResult(loss=loss, grad_norm=grad_norm, valid_tokens=norm.n_valid, extra=extra)

    def after_update(self, session: TrainingSession) -> None:
        for feature in self.features:
            feature.after_update(session)
