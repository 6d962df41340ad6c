"""The step core: one optimizer step's forward/backward over the micro-batches, written once.

A step function takes the session and the step's micro-batches (already on the device)
and returns a `StepResult`; the loop owns the optimizer update, NaN policy and logging.
The loss is normalised by the number of valid (non-ignored) label tokens across ALL
micro-batches of the step and all data-parallel ranks, not averaged per micro-batch, so
gradient accumulation and data parallelism give the same update as one big batch.

Under context parallelism every rank holds a part of each sequence, so "all ranks" means
dp x cp (`RuntimeContext.loss_group`, `loss_ranks`); without CP that is the dp group.

`TokenNormaliser` is that rule (count, all-reduce, scale); `accumulate` is the
micro-batch loop built on it (gradient sync only on the last micro-batch). `PlainStep`
runs it and clips; variants subclass it and override one phase (`VLMStep` drops frozen
gradients after the backward); the pipeline step uses the same normaliser inside its
schedule. Which variant a run uses is decided in one place, `engine.train.steps`.

Nothing here reads a tensor on the host: on a GPU every such read waits for all queued
work, so the step's numbers (token counts, loss, gradient norm) stay device scalars in
the `StepResult`, and the loop reads them (`StepResult.read`, one transfer) only on
logging steps. With fp16 the step also scales the loss by the gradient scaler's factor
(folded into the normaliser's scale) and unscales before measuring the norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.tensor import DTensor

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.parallel import clip_grad_norm, vocab_parallel_loss_sum
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.step_result import StepNumbers as StepNumbers  # re-exported: the records
from kforge_cli.engine.train.step_result import StepResult as StepResult  # live in step_result

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

Batch = dict[str, torch.Tensor]
# Batch keys passed to the model as keyword arguments when present (VLM batches add the pixels).
MODEL_INPUTS = ("doc_ids", "positions", "pixel_values", "frame_mask")


class StepFn(Protocol):
    """What the loop calls once per optimizer step."""

    def __call__(self, session: TrainingSession, micro_batches: list[Batch], /) -> StepResult: ...


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

    def mean(self, global_loss_sum: torch.Tensor) -> torch.Tensor:
        """The step's mean loss per valid token from the global loss sum (device scalar)."""
        return global_loss_sum.double() / self.n_valid.clamp(min=1).double()


def accumulate(
    session: TrainingSession, micro_batches: list[Batch], forward: Callable[[Batch], torch.Tensor]
) -> tuple[torch.Tensor, TokenNormaliser]:
    """Forward/backward every micro-batch (``forward`` returns its loss sum); gradients are
    reduced across data-parallel ranks only with the last one. Returns the global loss sum."""
    norm = TokenNormaliser.for_step(session, micro_batches)
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


class PlainStep:
    """Token-normalised accumulation, then clipping. Subclasses override one phase."""

    def __call__(self, session: TrainingSession, micro_batches: list[Batch]) -> StepResult:
        self.before_forward(session)
        datasets = DatasetLosses.for_step(session, micro_batches)
        base = datasets.forward if datasets is not None else (lambda batch: forward_loss_sum(session, batch))
        total, norm = accumulate(session, micro_batches, lambda batch: self.adjust_loss(session, batch, base(batch)))
        self.after_backward(session)
        grad_norm = clip_gradients(session)
        result = StepResult(
            loss=norm.mean(total), grad_norm=grad_norm, valid_tokens=norm.n_valid, extra=dict(self.extra())
        )
        if datasets is not None:
            datasets.reduce()
            result.deferred.append(datasets.means)
        return result

    def before_forward(self, session: TrainingSession) -> None:
        """Runs before the first micro-batch (nothing for plain training)."""

    def adjust_loss(self, session: TrainingSession, batch: Batch, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss sum one micro-batch backpropagates (plain training: unchanged)."""
        return loss_sum

    def after_backward(self, session: TrainingSession) -> None:
        """Runs after the last backward, before clipping (nothing for plain training)."""

    def extra(self) -> Mapping[str, float | torch.Tensor]:
        """Step metrics of this variant, merged into `StepResult.extra` (device scalars are read only when logged)."""
        return {}


plain_step = PlainStep()
