"""Evaluation: mean loss per valid token over `eval.steps` validation batches, all ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.parallel import shard_batch
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.settings import JobSettings

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession
    from kforge_cli.engine.train.step.core import Batch


def eval_batches(settings: JobSettings, *, pipeline: bool) -> int:
    """Validation batches per evaluation: eval.steps, under PP rounded up to a multiple of
    train.grad_accum_steps (the schedule evaluates that many micro-batches at a time)."""
    steps, group = settings.eval.steps, settings.train.grad_accum_steps
    return -(-steps // group) * group if pipeline else steps


def _eval_batches(session: TrainingSession) -> Iterator[Batch]:
    """The validation batches on the device; under PP, ``grad_accum_steps`` of them at a time
    (the schedule splits them back into its micro-batches)."""
    val = session.data.val
    assert val is not None
    cfg = session.settings.eval
    batch_size = cfg.batch_size or session.settings.train.batch_size
    device = session.runtime.device
    group = session.settings.train.grad_accum_steps if session.pipeline is not None else 1
    pending: list[Batch] = []
    for batch in val.iter_batches(eval_batches(session.settings, pipeline=session.pipeline is not None), batch_size):
        pending.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        if len(pending) == group:
            yield pending[0] if group == 1 else {k: torch.cat([b[k] for b in pending]) for k in pending[0]}
            pending = []


def evaluate(session: TrainingSession) -> float | None:
    """The eval loss, averaged over every valid token of every data-parallel rank (None: no val data).

    Under context parallelism each rank evaluates its shard of every sequence; the sums
    then span dp x cp."""
    if session.data.val is None:
        return None
    # here, not at import: the training package imports this module while it initialises
    from kforge_cli.engine.train.step.core import forward_loss_sum
    from kforge_cli.engine.train.step.schedule import pipeline_eval_loss_sum

    forward = pipeline_eval_loss_sum if session.pipeline is not None else forward_loss_sum
    totals = torch.zeros(2, device=session.runtime.device, dtype=torch.float64)
    runtime = session.runtime
    was_training = session.model.training
    session.model.eval()
    try:
        with torch.no_grad():
            for batch in _eval_batches(session):
                batch = shard_batch(batch, runtime.cp_rank, runtime.cp_size)
                totals[0] += forward(session, batch).double()
                totals[1] += (batch["labels"] != IGNORE_INDEX).sum()
    finally:
        session.model.train(was_training)
    all_reduce_sum(totals, runtime.loss_group())
    return float(totals[0] / totals[1].clamp(min=1))
