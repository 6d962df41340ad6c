"""The optimizer update of one step: fp16 loss scaling and the NaN policy, without host reads.

A host read of a device value waits for every kernel queued before it, so the update
decides on the device wherever it can:

- fp16 (`LossScaler`): torch's gradient scaler (``GradScaler`` on one process,
  ``ShardedGradScaler`` under FSDP2, whose DTensor gradients it unscales through DTensor's
  own ``_amp_foreach_non_finite_check_and_unscale_``) skips a step whose unscaled gradients
  hold an inf/NaN and lowers its scale; it raises the scale again after
  ``growth_interval`` clean steps. Skipped steps are counted on the device
  (``scaler/skipped_steps``). Its state lives in ``train_state.json`` (plain numbers), as
  the ``loss_scale`` of the checkpoint's ``update`` part.
- the NaN policy (``resilience.nan_policy``): with ``warn``, or an optimizer that can drop
  its own update given a ``found_inf`` flag (fused AdamW; under fp16 the scaler), the
  bad-step flag never leaves the device; otherwise the loss and norm are read once per
  step (see `engine.resilience.nan_guard`).

Without the fused kernel torch's scaler itself reads its flag once per step; fused AdamW
(the default on CUDA) needs none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from kforge_cli.common.json_values import dict_of
from kforge_cli.engine.resilience import NanGuard
from kforge_cli.engine.train.loss_scaler import LossScaler, build_loss_scaler
from kforge_cli.engine.train.step.result import StepResult

__all__ = ["LossScaler", "Update", "apply_update", "build_loss_scaler", "skips_on_device"]


class _Updating(Protocol):
    """What `apply_update` needs of the session (the session module names `Update`, not the other way)."""

    optimizer: torch.optim.Optimizer
    update: Update


log = logging.getLogger("kforge")


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer drops its own update given ``found_inf`` (torch's fused Adam/AdamW kernels)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _step_with_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` that the fused kernel itself skips when ``found_inf`` is 1 (the scaler's protocol)."""
    opt: Any = optimizer
    opt.found_inf = found_inf.to(torch.float32)
    try:
        optimizer.step()
    finally:
        del opt.found_inf


class Update:
    """The optimizer update of every step: the NaN policy's guard and, under fp16, the loss scale.

    A named part of every checkpoint (``update``): the loss scale is saved as part of it
    (plain numbers); the guard's counters belong to the NaN policy's component.
    """

    name = "update"

    def __init__(self, guard: NanGuard, scaler: LossScaler | None = None) -> None:
        self.guard, self.scaler = guard, scaler

    def apply(self, optimizer: torch.optim.Optimizer, step: int, result: StepResult) -> bool | torch.Tensor:
        """Apply (or skip) optimizer step ``step``; returns whether it was skipped (a device flag when
        decided on the device: read it only when needed). Raises TrainingAborted per the NaN policy."""
        guard, scaler = self.guard, self.scaler
        if scaler is not None:  # the scaler skips on non-finite gradients; the guard watches the loss
            bad = guard.flag(result.loss)
            guard.record(step, bad)
            return scaler.step(optimizer, result.grad_norm) | bad
        if guard.decides_on_device(skips_on_device(optimizer)):
            bad = guard.flag(result.loss, result.grad_norm)
            guard.record(step, bad)
            if guard.policy == "warn":
                optimizer.step()
                return False
            _step_with_found_inf(optimizer, bad)
            return bad
        loss, grad_norm = torch.stack([result.loss.double(), result.grad_norm.double().to(result.loss.device)]).tolist()
        action = guard.decide(step, loss, grad_norm)  # one host read per step: this optimizer cannot skip by itself
        if action == "apply":
            optimizer.step()
        return action == "skip"

    def metrics(self) -> dict[str, float]:
        """The loss scale and the steps it skipped (fp16; read on logging steps only)."""
        return self.scaler.metrics() if self.scaler is not None else {}

    def state_dict(self) -> dict[str, object]:
        return {"loss_scale": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: object) -> None:
        if self.scaler is None:
            return
        saved = dict_of(state, "update").get("loss_scale")
        if saved is None:  # a bf16/fp32 checkpoint continued in fp16
            log.info("the checkpoint has no fp16 loss-scaler state: starting from the initial scale")
            return
        self.scaler.load_state_dict(saved)

    def legacy_state(self, train_state: Mapping[str, object]) -> object:
        """Checkpoints before the loop components kept the loss scale at the top (``grad_scaler``)."""
        return {"loss_scale": train_state.get("grad_scaler")}


def apply_update(session: _Updating, step: int, result: StepResult) -> bool | torch.Tensor:
    """The session's update applied to step ``step`` (see `Update.apply`)."""
    return session.update.apply(session.optimizer, step, result)
