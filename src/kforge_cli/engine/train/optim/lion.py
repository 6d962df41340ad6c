"""Lion (EvoLved Sign Momentum, Chen et al. 2023): a sign update with one momentum buffer.

Why: half of AdamW's optimizer memory (one state tensor instead of two) and an update
of uniform magnitude. It usually wants a 3-10x smaller LR and a 3-10x larger weight
decay than AdamW. The update for a parameter ``p`` with gradient ``g``::

    c   = beta1 * m + (1 - beta1) * g          # interpolation used for the update
    p   = p * (1 - lr * wd) - lr * sign(c)     # decoupled weight decay, sign step
    m   = beta2 * m + (1 - beta2) * g          # momentum tracked with beta2

State per parameter: ``exp_avg`` (``m``), a tensor of the parameter's dtype (and, for a
DTensor parameter, of its sharding), so the state dict is DCP-compatible. All
operations are elementwise, so FSDP2-sharded DTensors need no gathering.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT


class Lion(Optimizer):
    """Lion with decoupled weight decay; a simple per-parameter loop (no foreach)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0.0:
            raise ValueError(f"Lion lr must be positive, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion betas must be in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one Lion update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr: float = group["lr"]
            beta1, beta2 = group["betas"]
            wd: float = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg: torch.Tensor = state["exp_avg"]
                update = exp_avg.lerp(grad, 1.0 - beta1).sign_()
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(update, alpha=-lr)
                exp_avg.lerp_(grad, 1.0 - beta2)
        return loss
