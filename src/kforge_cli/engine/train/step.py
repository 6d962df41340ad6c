"""Step functions: one optimizer step's forward/backward over the micro-batches.

A step function takes the session and the step's micro-batches (already on the device)
and returns a `StepResult`; the loop owns the optimizer update, NaN policy and logging.
The loss is normalised by the number of valid (non-ignored) label tokens across ALL
micro-batches of the step and all data-parallel ranks, not averaged per micro-batch, so
gradient accumulation and data parallelism give the same update as one big batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from kforge_cli.engine.parallel import clip_grad_norm, vocab_parallel_loss_sum
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession
    from kforge_cli.settings import JobSettings

Batch = dict[str, torch.Tensor]


@dataclass
class StepResult:
    loss: float  # global mean loss per valid token
    grad_norm: float  # total gradient norm before clipping
    valid_tokens: int  # global number of label tokens that counted
    extra: dict[str, float] = field(default_factory=dict)  # e.g. {"loss/<dataset>": ...}


StepFn = Callable[["TrainingSession", list[Batch]], StepResult]
# Batch keys passed to the model as keyword arguments when present (VLM batches add the pixels).
MODEL_INPUTS = ("doc_ids", "positions", "pixel_values", "frame_mask")


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


def _forward_loss_sum(session: TrainingSession, batch: Batch) -> torch.Tensor:
    if session.pipeline is not None:  # forward only (evaluation): the stages run in order
        from kforge_cli.engine.train.pipeline_step import pipeline_forward_loss_sum

        return pipeline_forward_loss_sum(session, batch)
    model, loss_fn = session.model, session.loss_fn
    kwargs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    with session.autocast():
        if model_computes_loss(session):
            return model(batch["input_ids"], labels=batch["labels"], loss_fn=loss_fn, **kwargs)
        logits = model(batch["input_ids"], **kwargs)
    return loss_sum_from_output(session, logits, batch["labels"])


def clip_gradients(session: TrainingSession) -> float:
    """Clip to train.grad_clip_norm (0 = only measure); returns the pre-clip total norm."""
    max_norm = session.settings.train.grad_clip_norm or math.inf
    params = [p for p in session.model.parameters() if p.grad is not None]
    # The norm spans every mesh dim: shards (dp, tp) and pipeline stages (pp) all contribute.
    return clip_grad_norm(params, max_norm, session.runtime.pp_group())


def _forward_loss_per_token(session: TrainingSession, batch: Batch) -> torch.Tensor:
    """Per-position losses [B, T] (plain data/FSDP path only), for per-dataset losses."""
    model, loss_fn = session.model, session.loss_fn
    kwargs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    with session.autocast():
        if model_computes_loss(session):
            return model(batch["input_ids"], labels=batch["labels"], loss_fn=loss_fn.per_token, **kwargs)
        logits = model(batch["input_ids"], **kwargs)
    return loss_fn.per_token_from_logits(logits, batch["labels"])


def _tracks_datasets(session: TrainingSession, micro_batches: list[Batch]) -> int:
    """Number of mixture datasets whose losses the step reports (0 = not tracked).

    Tracked on the plain path (one process or FSDP); under TP the logits are
    vocab-sharded and under PP the loss lives on the last stage, so only the total is kept.
    """
    names = getattr(session.data, "dataset_names", None) or []
    if len(names) < 2 or session.pipeline is not None or session.runtime.tp_size > 1:
        return 0
    return len(names) if all("dataset_ids" in mb for mb in micro_batches) else 0


def plain_step(session: TrainingSession, micro_batches: list[Batch]) -> StepResult:
    """Gradient accumulation over micro-batches with token-count normalisation."""
    device = session.runtime.device
    group = session.runtime.dp_group()
    local_valid = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    n_valid = all_reduce_sum(torch.tensor(float(local_valid), device=device), group)
    # Data-parallel gradient reduction averages over ranks; multiply back so the
    # effective loss is (global sum) / (global valid tokens).
    scale = session.runtime.dp_size / n_valid.clamp(min=1.0)
    total = torch.zeros((), device=device, dtype=torch.float32)
    n_datasets = _tracks_datasets(session, micro_batches)
    per_dataset = torch.zeros(2, max(n_datasets, 1), device=device, dtype=torch.float64)  # loss sums, tokens
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        sync = getattr(session.model, "set_requires_gradient_sync", None)
        if sync is not None:
            sync(i == last)
        if n_datasets:
            per_token = _forward_loss_per_token(session, batch)
            loss_sum = per_token.sum()
            ids = batch["dataset_ids"]
            per_dataset[0].index_add_(0, ids, per_token.detach().sum(dim=-1).double())
            per_dataset[1].index_add_(0, ids, (batch["labels"] != IGNORE_INDEX).sum(dim=-1).double())
        else:
            loss_sum = _forward_loss_sum(session, batch)
        (loss_sum * scale).backward()
        total += loss_sum.detach().float()
    total = all_reduce_sum(total, group)
    grad_norm = clip_gradients(session)
    n = float(n_valid)
    extra: dict[str, float] = {}
    if n_datasets:
        all_reduce_sum(per_dataset, group)
        for name, loss_sum, tokens in zip(session.data.dataset_names, *per_dataset.tolist(), strict=True):
            if tokens > 0:
                extra[f"loss/{name}"] = loss_sum / tokens
    return StepResult(loss=float(total) / max(n, 1.0), grad_norm=grad_norm, valid_tokens=int(n), extra=extra)


def select_step_fn(settings: JobSettings) -> StepFn:
    """The step function for this configuration (pipeline and VLM variants register here)."""
    if settings.distributed.pp > 1:
        from kforge_cli.engine.train.pipeline_step import pipeline_step

        return pipeline_step
    if settings.vlm is not None:
        from kforge_cli.engine.train.vlm_step import vlm_step_fn

        return vlm_step_fn()
    return plain_step
