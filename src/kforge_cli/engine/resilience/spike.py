"""Loss-spike guard: notice a step whose loss jumps far above its recent history.

A spike is a finite loss above both ``mean + spike_sigma x std`` and ``spike_ratio x mean``
of the last ``spike_window`` clean losses (the guard starts once it has that many).
Spiking and non-finite losses stay out of the history (the NaN policy owns those), so
one spike neither raises the threshold nor pauses the guard.

Like the NaN policy's device path, the check runs on the device every step (a dozen
scalar kernels, no host read): the history is a ring buffer, and a tally keeps the
spikes seen since the last `settle` (how many, the first one's step, loss and
threshold). `settle` runs at the same steps on every rank (logging steps, before a
checkpoint save, at a stop and at the end); it broadcasts rank 0's tally, so every rank
takes the same decision, and reads it (one host read). What happens then
(``resilience.spike_policy``: report, or rewind to the last checkpoint) is the training
loop's business (`engine.train.rewind`).

The history and the counters travel in ``train_state.json``, so a resumed or rewound
run keeps guarding from its first step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kforge_cli.common.json_values import float_of, int_of, list_of
from kforge_cli.settings.infrastructure import ResilienceSettings

# Tally slots: spikes since the last settle, the first one's step, loss and threshold.
_COUNT, _STEP, _LOSS, _THRESHOLD = range(4)


@dataclass(frozen=True)
class SpikeEvent:
    """The spikes found by one `settle` (agreed across ranks)."""

    step: int  # the first spiking step since the previous settle
    loss: float
    threshold: float
    count: int  # spiking steps since the previous settle

    def record(self) -> dict[str, float | int]:
        return {
            "spike/step": self.step,
            "spike/loss": self.loss,
            "spike/threshold": self.threshold,
            "spike/count": self.count,
        }


class SpikeGuard:
    """Device-side loss-spike detection (see the module docstring)."""

    def __init__(
        self,
        policy: Literal["off", "warn", "rewind"],
        window: int,
        sigma: float,
        ratio: float,
        max_rewinds: int,
    ) -> None:
        self.policy, self.window, self.sigma, self.ratio = policy, window, sigma, ratio
        self.max_rewinds = max_rewinds
        self.rewinds = 0  # rewinds so far in this run (all attempts)
        self.detected = 0  # spiking steps so far
        self._hist: torch.Tensor | None = None  # [window] float64 ring buffer of clean losses
        self._filled: torch.Tensor | None = None  # [window] bool
        self._next: torch.Tensor | None = None  # int64 scalar: clean losses seen (the ring position)
        self._tally: torch.Tensor | None = None
        self._loaded: dict[str, object] | None = None  # a checkpoint's state, put on the device at the next step

    @classmethod
    def from_settings(cls, cfg: ResilienceSettings) -> SpikeGuard:
        return cls(cfg.spike_policy, cfg.spike_window, cfg.spike_sigma, cfg.spike_ratio, cfg.spike_max_rewinds)

    @property
    def enabled(self) -> bool:
        return self.policy != "off"

    @property
    def may_rewind(self) -> bool:
        return self.policy == "rewind" and self.rewinds < self.max_rewinds

    def _allocate(self, device: torch.device) -> None:
        state = self._loaded or {}
        hist = [float_of(v) for v in list_of(state.get("history", []), "history")][: self.window]
        filled = [bool(v) for v in list_of(state.get("filled", []), "filled")][: self.window]
        pad = self.window - len(hist)
        self._hist = torch.tensor(hist + [0.0] * pad, dtype=torch.float64, device=device)
        self._filled = torch.tensor((filled + [False] * self.window)[: self.window], device=device)
        self._next = torch.tensor(int_of(state.get("next", 0)), dtype=torch.int64, device=device)
        self._loaded = None

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """Check optimizer step ``step``'s loss (a global device scalar) and add it to the history."""
        if self._hist is None or self._loaded is not None:
            self._allocate(loss.device)
        hist, filled, nxt = self._hist, self._filled, self._next
        assert hist is not None and filled is not None and nxt is not None
        x = loss.detach().to(torch.float64)
        count = filled.sum()
        mean = torch.where(filled, hist, 0.0).sum() / count.clamp(min=1)
        var = torch.where(filled, hist - mean, 0.0).square().sum() / (count - 1).clamp(min=1)
        threshold = torch.maximum(mean + self.sigma * var.sqrt(), self.ratio * mean)
        finite = torch.isfinite(x)
        spike = finite & (count >= self.window) & (x > threshold)
        clean = finite & ~spike
        slot = (nxt % self.window).view(1)
        hist.index_copy_(0, slot, torch.where(clean, x, hist.index_select(0, slot)[0]).view(1))
        filled.index_copy_(0, slot, (filled.index_select(0, slot)[0] | clean).view(1))
        nxt += clean.to(torch.int64)
        first = spike & (self._tally[_COUNT] == 0) if self._tally is not None else spike
        t = self._tally if self._tally is not None else torch.zeros(4, dtype=torch.float64, device=x.device)
        self._tally = torch.stack(
            [
                t[_COUNT] + spike.to(torch.float64),
                torch.where(first, float(step), t[_STEP]),
                torch.where(first, x, t[_LOSS]),
                torch.where(first, threshold, t[_THRESHOLD]),
            ]
        )

    def settle(self, agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SpikeEvent | None:
        """The spikes since the last settle (rank 0's, through ``agree`` on every rank), or None."""
        if self._tally is None:
            return None
        tally = agree(self._tally) if agree is not None else self._tally
        count, step, loss, threshold = tally.tolist()
        self._tally = None
        if not count:
            return None
        self.detected += int(count)
        return SpikeEvent(step=int(step), loss=loss, threshold=threshold, count=int(count))

    def state_dict(self) -> dict[str, object]:
        """JSON: the history (a host read, on saves only) and the counters."""
        history: list[float]
        filled: list[object]
        nxt: object
        if self._hist is None or self._filled is None or self._next is None:
            loaded = self._loaded or {}
            history, filled, nxt = (
                [float_of(v) for v in list_of(loaded.get("history", []), "history")],
                list(list_of(loaded.get("filled", []), "filled")),
                loaded.get("next", 0),
            )
        else:
            history, filled, nxt = self._hist.tolist(), self._filled.tolist(), int(self._next)
        history = [v if math.isfinite(v) else 0.0 for v in history]
        return {"history": history, "filled": filled, "next": nxt, "rewinds": self.rewinds, "detected": self.detected}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._loaded = {k: state.get(k) for k in ("history", "filled", "next")}
        self._loaded = {k: v for k, v in self._loaded.items() if v is not None}
        self._hist = self._filled = self._next = self._tally = None
        self.rewinds = int_of(state.get("rewinds", 0))
        self.detected = int_of(state.get("detected", 0))
