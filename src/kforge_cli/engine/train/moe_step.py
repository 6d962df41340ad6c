"""The MoE step: the plain step plus the routers' auxiliary losses and once-per-step balancing.

Aux losses: each MoE layer keeps the weighted load-balance and z-loss of its latest
forward. They are added to a micro-batch's loss *sum* multiplied by the micro-batch's
valid tokens, so after the step core's division by the global token count (and the
data-parallel gradient average) their gradient is the token-weighted mean over all
micro-batches and ranks; the load-balance loss's expert shares are those of the whole
global micro-batch (all-reduced in the forward), so data parallelism trains exactly like
one process on the same global batch. They enter as ``term - term.detach()``: the gradient is the
aux loss's, the reported ``loss`` stays the language-model loss, and the aux values
are logged separately (``moe/<layer>/aux_loss``).

Balancing: after the last backward, `finish_moe_step` all-reduces the step's expert
counts over the data-parallel ranks (every rank that routes distinct tokens: tensor-parallel
peers route the same ones, see engine.parallel.tensor_parallel, and are not summed), updates
the selection biases identically everywhere and returns the per-layer load metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.model.moe import finish_moe_step, moe_aux_loss, moe_layers
from kforge_cli.engine.train.step import Batch, PlainStep

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession


def share_load_over_data_parallel(session: TrainingSession) -> None:
    """Let every MoE layer's load-balance loss use the expert load of all data-parallel ranks."""
    distributed = session.runtime.dp_size > 1
    for _, layer in moe_layers(session.model):
        layer.load_group, layer.global_load = session.runtime.dp_group(), distributed


class MoEStep(PlainStep):
    """Plain step + aux losses in the backward + bias update and load metrics once per step."""

    def __init__(self) -> None:
        self.metrics: dict[str, torch.Tensor] = {}

    def before_forward(self, session: TrainingSession) -> None:
        share_load_over_data_parallel(session)

    def adjust_loss(self, session: TrainingSession, batch: Batch, loss_sum: torch.Tensor) -> torch.Tensor:
        aux = moe_aux_loss(session.model)
        if aux is None:
            return loss_sum
        term = aux * (batch["labels"] != IGNORE_INDEX).sum()
        return loss_sum + (term - term.detach()).to(loss_sum.dtype)

    def after_backward(self, session: TrainingSession) -> None:
        self.metrics = finish_moe_step(session.model, session.runtime.dp_group())

    def extra(self) -> dict[str, torch.Tensor]:
        return dict(self.metrics)
