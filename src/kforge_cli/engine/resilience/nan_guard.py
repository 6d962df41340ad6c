"""NaN/Inf policy: decide, identically on every rank, what to do with a bad step.

The decision is taken from values that are already global (the loss all-reduced over
data-parallel ranks, the total gradient norm over every mesh dim), so ranks can never
disagree and desynchronise. The scheduler and step counter advance on skipped steps
too; only the parameter update is dropped.

Two ways to decide, chosen per run by `NanGuard.decides_on_device`:

- on the host (`decide`): the loss and norm are read every step (one device sync). Used
  for ``skip`` / ``abort`` when the optimizer cannot skip an update by itself.
- on the device (`flag` + `record`): the bad-step flag stays a device scalar; ``skip`` and
  ``abort`` hand it to an optimizer that can drop its own update (fused AdamW's
  ``found_inf``, the fp16 gradient scaler), ``warn`` needs no decision at all. Tallies
  (bad steps, skipped steps, the longest run of consecutive bad steps) accumulate on the
  device and are read by `settle` on logging steps, stop checks and saves, which logs
  them and, under ``abort``, stops the run: at most a logging interval after the limit
  was reached, every step in between skipped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from kforge_cli.errors import TrainingAborted
from kforge_cli.settings.infrastructure import ResilienceSettings

Action = Literal["apply", "skip"]

log = logging.getLogger("kforge")

# Device tallies since the last settle: bad steps, skipped steps, current run, longest run, last bad step.
_BAD, _SKIPPED, _RUN, _PEAK, _LAST = range(5)


@dataclass
class NanGuard:
    """Tracks bad steps and applies the configured policy."""

    policy: Literal["warn", "skip", "abort"]
    max_consecutive: int
    consecutive: int = 0
    total_bad: int = 0
    total_skipped: int = 0
    _tally: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_settings(cls, cfg: ResilienceSettings) -> NanGuard:
        return cls(policy=cfg.nan_policy, max_consecutive=cfg.nan_max_consecutive)

    def decides_on_device(self, can_skip_on_device: bool) -> bool:
        """True when no host read is needed per step: ``warn``, or an optimizer that skips by itself."""
        return self.policy == "warn" or can_skip_on_device

    @staticmethod
    def flag(loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The step's bad flag (bool device scalar): a non-finite loss or gradient norm."""
        bad = ~torch.isfinite(loss)
        if grad_norm is not None:
            bad = bad | ~torch.isfinite(grad_norm.to(loss.device))
        return bad

    def record(self, step: int, bad: torch.Tensor) -> None:
        """Add one step's flag to the device tallies (no host read); `settle` acts on them."""
        b = bad.to(torch.float64)
        if self._tally is None:
            self._tally = torch.zeros(5, dtype=torch.float64, device=bad.device)
            self._tally[_RUN] = self.consecutive
            self._tally[_PEAK] = self.consecutive
        t = self._tally
        run = (t[_RUN] + 1) * b
        skipped = b if self.policy != "warn" else torch.zeros_like(b)
        last = torch.where(bad, torch.full_like(b, step), t[_LAST])
        self._tally = torch.stack([t[_BAD] + b, t[_SKIPPED] + skipped, run, torch.maximum(t[_PEAK], run), last])

    def settle(self) -> None:
        """Read the device tallies (one host read), log them, and stop the run when ``abort`` says so."""
        window = self._fold()
        if window is None:
            return
        bad, skipped, peak, last = window
        what = (
            "applied anyway (resilience.nan_policy = 'warn')"
            if self.policy == "warn"
            else f"{skipped} update(s) skipped"
        )
        log.warning(
            "%d step(s) with a non-finite loss/grad norm since the last check, last at step %d: %s", bad, last, what
        )
        if self.policy == "abort" and peak >= self.max_consecutive:
            raise TrainingAborted(
                f"non-finite loss/grad norm: {peak} consecutive bad step(s) (last at step {last}) reached "
                f"resilience.nan_max_consecutive = {self.max_consecutive}; stopping (resilience.nan_policy = 'abort')"
            )

    def _fold(self) -> tuple[int, int, int, int] | None:
        """Move the device tallies into the host counters; (bad, skipped, longest run, last bad step) or None.

        Called at the same steps on every rank (logging steps, stop checks, the end), so every
        rank folds the same windows and takes the same abort decision.
        """
        if self._tally is None:
            return None
        bad, skipped, run, peak, last = (int(v) for v in self._tally.tolist())
        self._tally = None
        self.consecutive = run
        if not bad:
            return None
        self.total_bad += bad
        self.total_skipped += skipped
        return bad, skipped, peak, last

    def decide(self, step: int, loss: float, grad_norm: float, bad_anywhere: bool | None = None) -> Action:
        """'apply' or 'skip' for optimizer step `step`; raises TrainingAborted per policy.

        `bad_anywhere` is the all-reduced flag when the caller has one; else it is derived
        from the (already global) loss and gradient norm.
        """
        bad = bad_anywhere if bad_anywhere is not None else not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not bad:
            self.consecutive = 0
            return "apply"
        self.consecutive += 1
        self.total_bad += 1
        what = f"non-finite loss/grad norm at step {step} (loss={loss}, grad_norm={grad_norm})"
        if self.policy == "warn":
            log.warning("%s: applying the update anyway (resilience.nan_policy = 'warn')", what)
            return "apply"
        self.total_skipped += 1
        if self.policy == "abort" and self.consecutive >= self.max_consecutive:
            raise TrainingAborted(
                f"{what}: {self.consecutive} consecutive bad step(s) reached "
                f"resilience.nan_max_consecutive = {self.max_consecutive}; stopping (resilience.nan_policy = 'abort')"
            )
        log.warning("%s: skipping the update (%d in a row)", what, self.consecutive)
        return "skip"

    def state_dict(self) -> dict[str, int]:
        """Host counters plus the unsettled device tallies (read, not folded: only rank 0 saves this)."""
        if self._tally is None:
            return {"consecutive": self.consecutive, "total_bad": self.total_bad, "total_skipped": self.total_skipped}
        bad, skipped, run, _, _ = (int(v) for v in self._tally.tolist())
        return {"consecutive": run, "total_bad": self.total_bad + bad, "total_skipped": self.total_skipped + skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._tally = None
        self.consecutive = int(state.get("consecutive", 0))
        self.total_bad = int(state.get("total_bad", 0))
        self.total_skipped = int(state.get("total_skipped", 0))
