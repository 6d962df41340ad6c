"""NaN/Inf policy: decide, identically on every rank, what to do with a bad step.

The decision is taken from values that are already global (the loss all-reduced over
data-parallel ranks, the total gradient norm over every mesh dim) and the flag is
all-reduced once more, so ranks can never disagree and desynchronise. The scheduler and
step counter advance on skipped steps too; only the parameter update is dropped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from kforge_cli.errors import TrainingAborted
from kforge_cli.settings.infrastructure import ResilienceSettings

Action = Literal["apply", "skip"]

log = logging.getLogger("kforge")


@dataclass
class NanGuard:
    """Tracks bad steps and applies the configured policy."""

    policy: Literal["warn", "skip", "abort"]
    max_consecutive: int
    consecutive: int = 0
    total_bad: int = 0
    total_skipped: int = 0

    @classmethod
    def from_settings(cls, cfg: ResilienceSettings) -> NanGuard:
        return cls(policy=cfg.nan_policy, max_consecutive=cfg.nan_max_consecutive)

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
        return {"consecutive": self.consecutive, "total_bad": self.total_bad, "total_skipped": self.total_skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total_bad = int(state.get("total_bad", 0))
        self.total_skipped = int(state.get("total_skipped", 0))
