"""The optimizer update of one step: fp16 loss scaling and the NaN policy, without host reads.

A host read of a device value waits for every kernel queued before it, so the update
decides on the device wherever it can:

- fp16 (`LossScaler`): torch's gradient scaler (``GradScaler`` on one process,
  ``ShardedGradScaler`` under FSDP2, whose DTensor gradients it unscales through DTensor's
  own ``_amp_foreach_non_finite_check_and_unscale_``) skips a step whose unscaled gradients
  hold an inf/NaN and lowers its scale; it raises the scale again after
  ``growth_interval`` clean steps. Skipped steps are counted on the device
  (``scaler/skipped_steps``). Its state lives in ``train_state.json`` (plain numbers).
- the NaN policy (``resilience.nan_policy``): with ``warn``, or an optimizer that can drop
  its own update given a ``found_inf`` flag (fused AdamW; under fp16 the scaler), the
  bad-step flag never leaves the device; otherwise the loss and norm are read once per
  step (see `engine.resilience.nan_guard`).

Without the fused kernel torch's scaler itself reads its flag once per step; fused AdamW
(the default on CUDA) needs none.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kforge_cli.engine.train.loss_scaler import LossScaler, build_loss_scaler
from kforge_cli.engine.train.step.result import StepResult

__all__ = ["LossScaler", "apply_update", "build_loss_scaler", "skips_on_device"]

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

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


def apply_update(session: TrainingSession, step: int, result: StepResult) -> bool | torch.Tensor:
    """Apply (or skip) optimizer step ``step``; returns whether it was skipped (a device flag when
    decided on the device: read it only when needed). Raises TrainingAborted per the NaN policy."""
    guard, optimizer, scaler = session.nan_guard, session.optimizer, session.grad_scaler
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
