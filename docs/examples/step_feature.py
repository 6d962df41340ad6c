"""A step feature: the token embeddings stay frozen for the first `steps` optimizer updates.

Use it next to the features kforge picks for the configuration::

    run_training(settings, features=lambda s: [*features_for(s), FreezeEmbeddingsForWarmup(steps=100)])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kforge_cli.engine.train.features import init_optimizer_state
from kforge_cli.engine.train.step import Batch, StepFeature


class FreezeEmbeddingsForWarmup(StepFeature):
    """Drops the embedding's gradient after the backward while `session.state.step < steps`."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.frozen = False

    def before_step(self, session: Any, micro_batches: Sequence[Batch]) -> None:
        # Every parameter gets its (zero) optimizer state before the first update, so a checkpoint
        # saved while the embedding is frozen holds the same tensors as one saved after.
        init_optimizer_state(session.optimizer)
        self.frozen = session.state.step < self.steps  # completed steps: this is update step + 1

    def after_backward(self, session: Any) -> None:
        if self.frozen:  # no gradient: the optimizer skips it, and the clipped norm ignores it
            for name, param in session.model.named_parameters():
                if "tok_embeddings" in name:
                    param.grad = None

    def metrics(self) -> Mapping[str, float | torch.Tensor]:
        return {"embeddings_frozen": float(self.frozen)}  # logged in metrics.jsonl with the step
