"""The VLM freeze schedule as a step feature.

Freezing never touches ``requires_grad``, the optimizer's parameter groups or FSDP's
shards: after the backward, the gradients of the parameters frozen for this update are
set to None, so the optimizer skips them (no update, no weight decay, no moment
change) and the clipped gradient norm ignores them. Unfreezing at step S is therefore
just "stop dropping", under FSDP too.

A parameter the optimizer has never updated has no optimizer state, which would make
checkpoints of a run with a frozen module lack those tensors and a resume build them
differently. So before the first update of a fresh run every parameter gets the state
the optimizer would create lazily (all zeros, step 0), by one update with zero
gradients and zero learning rate whose state is then zeroed. For AdamW, Lion and Muon
that is exactly their lazy initial state, so training is unchanged, and a frozen
module's state survives save/resume bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.model.module_names import clean_param_name
from kforge_cli.engine.model.vlm import check_specs, frozen_names, frozen_specs_at
from kforge_cli.engine.train.step.core import Batch, StepFeature

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Give every parameter its (all-zero) initial optimizer state; False when the state already exists."""
    if optimizer.state:
        return False
    saved_lrs = []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()
    return True


class FreezeController:
    """Which parameters of ``model`` are frozen for the update after a given step (see engine.model.vlm.freeze)."""

    def __init__(self, session: TrainingSession) -> None:
        vlm = session.settings.vlm
        assert vlm is not None
        self.vlm = vlm
        self.params = dict(session.model.named_parameters())
        check_specs(vlm, self.params)
        self.is_main = session.runtime.is_main
        self._specs: tuple[str, ...] | None = None
        self._frozen: list[torch.Tensor] = []
        self.frozen_numel = 0

    def frozen_at(self, step: int) -> list[torch.Tensor]:
        """The parameters frozen for the update after ``step`` completed steps (logs each change)."""
        specs = frozen_specs_at(self.vlm, step)
        if specs != self._specs:
            names = frozen_names(self.params, specs)
            by_clean = {n: p for n, p in self.params.items() if clean_param_name(n) in names}
            self._frozen = list(by_clean.values())
            self.frozen_numel = sum(p.numel() for p in self._frozen)
            if self.is_main and (self._specs is not None or specs):
                log.info(
                    "freeze from step %d: %s (%d parameters frozen)",
                    step + 1,
                    ", ".join(specs) or "nothing",
                    self.frozen_numel,
                )
            self._specs = specs
        return self._frozen


class FreezeFeature(StepFeature):
    """Frozen parameters' gradients are dropped after the backward, per the freeze schedule."""

    def __init__(self) -> None:
        self.freeze: FreezeController | None = None
        self._frozen: list[torch.Tensor] = []

    def before_step(self, session: TrainingSession, micro_batches: Sequence[Batch]) -> None:
        if self.freeze is None:
            self.freeze = FreezeController(session)
        if init_optimizer_state(session.optimizer):
            log.debug("optimizer state initialised for all %d parameters", len(self.freeze.params))
        self._frozen = self.freeze.frozen_at(session.state.step)

    def after_backward(self, session: TrainingSession) -> None:
        for p in self._frozen:
            p.grad = None

    def metrics(self) -> Mapping[str, float | torch.Tensor]:
        return {"frozen_params": float(self.freeze.frozen_numel if self.freeze is not None else 0)}
