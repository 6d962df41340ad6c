"""Evaluation: mean loss per valid token over `eval.steps` validation batches, all ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.loss import IGNORE_INDEX
from kforge_cli.engine.train.step import _forward_loss_sum

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession


def evaluate(session: TrainingSession) -> float | None:
    """The eval loss, averaged over every valid token of every data-parallel rank (None: no val data)."""
    val = getattr(session.data, "val", None)
    if val is None:
        return None
    cfg = session.settings.eval
    batch_size = cfg.batch_size or session.settings.train.batch_size
    device = session.runtime.device
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    was_training = session.model.training
    session.model.eval()
    try:
        with torch.no_grad():
            for batch in val.iter_batches(cfg.steps, batch_size):
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                totals[0] += _forward_loss_sum(session, batch).double()
                totals[1] += (batch["labels"] != IGNORE_INDEX).sum()
    finally:
        session.model.train(was_training)
    all_reduce_sum(totals, session.runtime.dp_group())
    return float(totals[0] / totals[1].clamp(min=1))
