"""`LossScaler`: torch's gradient scaler for fp16 (see `engine.train.update` for how the update uses it).

Its own module so the session can name its type without importing the update.
"""

from __future__ import annotations

import math
import warnings

import torch

from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.runtime import RuntimeContext

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

    def state_dict(self) -> dict[str, object]:
        return {**self.scaler.state_dict(), "skipped_steps": int(self.skipped)}

    def load_state_dict(self, state: object) -> None:
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
