"""Multi-token prediction (DeepSeek-V3) as a step feature: its loss in the backward, reported apart.

The model's training forward leaves each MTP depth's output in ``mtp_outputs`` (logits, a
vocabulary-sharded DTensor under loss-parallel TP, or the loss sum when the model computed a
chunked loss). After each micro-batch's forward, `loss_term` turns them into loss sums over the
depth's labels (the micro-batch's labels shifted left by the depth, the last positions
ignored) and returns ``mtp_loss_weight / depth x (sum over depths of the sums) / n`` with ``n``
this micro-batch's valid next-token labels; the accumulating executor weights the term by ``n``
and the step divides by the step's global count, so the gradient is that of
``loss + mtp_loss_weight x mtp_loss`` where ``mtp_loss`` is the MTP cross-entropy summed over
depths and tokens, divided by the depth and the step's next-token count (each depth has ``k``
fewer labels per sequence than the main loss; DeepSeek-V3 averages each depth over its own
tokens, the same up to ``k / seq_len``). The reported ``loss`` stays the next-token loss;
``mtp/loss`` (and ``mtp/<k>/loss`` per depth) is each depth's mean cross-entropy over its own
valid labels, all-reduced over the ranks whose tokens differ. Pipeline parallelism and context
parallelism are refused with MTP by the settings rules (``model.mtp_depth``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.families.deepseek_v3.model import DeepseekV3Transformer, mtp_labels
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.step.core import Batch, StepFeature, loss_sum_from_output

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession


def mtp_model(model: torch.nn.Module) -> DeepseekV3Transformer | None:
    """The module holding the MTP modules (None: the model has none)."""
    for module in model.modules():
        if isinstance(module, DeepseekV3Transformer) and module.mtp is not None:
            return module
    return None


class MTPFeature(StepFeature):
    """The MTP loss term per micro-batch and its per-depth metrics (see module docstring)."""

    def __init__(self, depth: int, weight: float) -> None:
        self.depth, self.weight = depth, weight
        self.sums: torch.Tensor | None = None  # [2, depth]: loss sums and valid label counts of the step
        self.metrics_: dict[str, torch.Tensor] = {}

    def loss_term(self, session: TrainingSession, batch: Batch) -> torch.Tensor | None:
        model = mtp_model(session.model)
        if model is None or not model.mtp_outputs:
            return None
        labels = batch["labels"]
        losses, counts = [], []
        for k, out in enumerate(model.mtp_outputs, start=1):
            target = mtp_labels(labels, k)
            losses.append(out.sum() if model.mtp_computes_loss else loss_sum_from_output(session, out, target))
            counts.append((target != IGNORE_INDEX).sum())
        model.mtp_outputs = []
        stacked = torch.stack([torch.stack([x.float() for x in losses]).detach(), torch.stack(counts).float()])
        self.sums = stacked if self.sums is None else self.sums + stacked
        n = (labels != IGNORE_INDEX).sum().clamp(min=1).float()
        return self.weight / self.depth * torch.stack(losses).float().sum() / n

    def after_backward(self, session: TrainingSession) -> None:
        if self.sums is None:
            self.metrics_ = {}
            return
        sums = all_reduce_sum(self.sums, session.runtime.loss_group())
        self.sums = None
        per_depth = sums[0] / sums[1].clamp(min=1)
        self.metrics_ = {"mtp/loss": per_depth.mean()}
        if self.depth > 1:
            self.metrics_.update({f"mtp/{k}/loss": per_depth[k - 1] for k in range(1, self.depth + 1)})

    def metrics(self) -> Mapping[str, float | torch.Tensor]:
        return dict(self.metrics_)
