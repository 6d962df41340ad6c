"""A step's result records: device scalars (`StepResult`) and their host copy (`StepNumbers`).

In a module of their own so the session, the step core and the update can all name them
without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepNumbers:
    """A step's numbers on the host (what the logs and hooks see)."""

    loss: float  # global mean loss per valid token
    grad_norm: float  # total gradient norm before clipping
    valid_tokens: int  # global number of label tokens that counted
    extra: dict[str, float]  # e.g. {"loss/<dataset>": ...}


@dataclass
class StepResult:
    """One step's numbers, left where they were computed (device scalars); `read` brings them over."""

    loss: torch.Tensor  # 0-dim: global mean loss per valid token
    grad_norm: torch.Tensor  # 0-dim: total gradient norm before clipping
    valid_tokens: torch.Tensor  # 0-dim: global number of label tokens that counted
    extra: dict[str, float | torch.Tensor] = field(default_factory=dict)  # e.g. {"frozen_params": ...}
    deferred: list[Callable[[], dict[str, float]]] = field(default_factory=list)  # metrics computed on read
    _numbers: StepNumbers | None = field(default=None, repr=False)

    def read(self) -> StepNumbers:
        """The numbers on the host: one device-to-host transfer for all scalars (cached)."""
        if self._numbers is None:
            names = [k for k, v in self.extra.items() if isinstance(v, torch.Tensor)]
            scalars = [self.loss, self.grad_norm, self.valid_tokens, *(self.extra[k] for k in names)]
            device = self.loss.device
            # float64: token counts stay exact far beyond fp32's 2**24
            values = torch.stack([torch.as_tensor(t).detach().to(device, torch.float64).reshape(()) for t in scalars])
            loss, grad_norm, tokens, *rest = values.tolist()
            extra = {k: float(v) for k, v in self.extra.items() if not isinstance(v, torch.Tensor)}
            extra.update(zip(names, rest, strict=True))
            for compute in self.deferred:
                extra.update(compute())
            self._numbers = StepNumbers(loss=loss, grad_norm=grad_norm, valid_tokens=int(tokens), extra=extra)
        return self._numbers
