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
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.engine.train.step import StepResult

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")

_SCALER_NUMBERS = {"scale": float, "growth_factor": float, "backoff_factor": float}


class LossScaler:
    """torch's gradient scaler for fp16, plus a device count of the steps it skipped."""

    def __init__(self, runtime: RuntimeContext) -> None:
        kind = runtime.device.type
        if runtime.world_size > 1:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler: torch.amp.GradScaler = ShardedGradScaler(device=kind)
        else:
            self.scaler = torch.amp.GradScaler(kind)
        self.skipped = torch.zeros((), dtype=torch.int64, device=runtime.device)

    def scale(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` times the current loss scale (device scalar)."""
        return self.scaler.scale(value)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        with warnings.catch_warnings():
            # ShardedGradScaler's found_inf / inv_scale have shape (1,); DTensor replicates them as
            # intended and warns that a 0-d tensor would be tidier: noise, once per rank.
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
        """Apply the update unless the (unscaled) gradients overflowed; returns that flag (device bool)."""
        overflow = ~torch.isfinite(grad_norm)
        self.scaler.step(optimizer)
        self.scaler.update()
        self.skipped += overflow.to(self.skipped.device, torch.int64)
        return overflow

    def metrics(self) -> dict[str, float]:
        """Read on logging steps only."""
        return {"scaler/scale": float(self.scaler.get_scale()), "scaler/skipped_steps": float(self.skipped)}

    def state_dict(self) -> dict[str, Any]:
        return {**self.scaler.state_dict(), "skipped_steps": int(self.skipped)}

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's scaler state, checked before use (it is read from disk)."""
        problems = []
        if not isinstance(state, dict):
            raise CheckpointError(f"train state: grad_scaler must be an object, got {type(state).__name__}")
        for key, kind in {
            **_SCALER_NUMBERS,
            "growth_interval": int,
            "_growth_tracker": int,
            "skipped_steps": int,
        }.items():
            value = state.get(key)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
            if not ok or (kind is int and not isinstance(value, int)):
                problems.append(f"{key}={value!r}")
        if problems or state["scale"] <= 0:
            raise CheckpointError(
                f"train state: grad_scaler has invalid values ({', '.join(problems) or 'scale <= 0'})"
            )
        self.scaler.load_state_dict({k: v for k, v in state.items() if k != "skipped_steps"})
        self.skipped.fill_(int(state["skipped_steps"]))


def build_loss_scaler(compute_dtype: torch.dtype, runtime: RuntimeContext) -> LossScaler | None:
    """A scaler when the compute dtype is fp16 (bf16 and fp32 have fp32's exponent range: none needed)."""
    return LossScaler(runtime) if compute_dtype == torch.float16 else None


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
