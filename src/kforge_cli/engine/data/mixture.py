"""Mixture weights: per-dataset weights, a temperature, and phases that change them by step.

Probabilities are ``weight ** (1 / temperature)`` renormalised, so a temperature above
1 flattens the mixture toward uniform and below 1 sharpens it. A phase with
``dataset_weights`` replaces the weights from its ``start_step`` on (datasets it does
not name get weight 0, e.g. an annealing phase on high-quality data only); a phase
with empty ``dataset_weights`` keeps the weights in force (it only scales the LR,
which is the scheduler's business).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.data import DataPhase


def mixture_probs(weights: Sequence[float], temperature: float, where: str) -> np.ndarray:
    """Normalised ``weights ** (1/temperature)``; ``where`` names the setting in errors."""
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not np.isfinite(w).all():
        raise InvalidInputError(f"{where}: mixture weights must be finite and >= 0, got {list(weights)}")
    p = np.where(w > 0, w, 0.0) ** (1.0 / temperature)
    if p.sum() <= 0:
        raise InvalidInputError(f"{where}: at least one dataset needs a weight > 0")
    return p / p.sum()


@dataclass(frozen=True)
class MixtureSchedule:
    """Dataset probabilities as a function of the optimizer step."""

    names: tuple[str, ...]
    base: np.ndarray
    phases: tuple[tuple[int, np.ndarray], ...] = ()

    @classmethod
    def build(
        cls, names: Sequence[str], weights: Sequence[float], temperature: float, phases: Sequence[DataPhase] = ()
    ) -> MixtureSchedule:
        base = mixture_probs(weights, temperature, "data.datasets")
        built: list[tuple[int, np.ndarray]] = []
        current = base
        for i, phase in enumerate(sorted(phases, key=lambda p: p.start_step)):
            unknown = sorted(set(phase.dataset_weights) - set(names))
            if unknown:
                raise InvalidInputError(
                    f"data.phases.{i}.dataset_weights: unknown dataset(s) {', '.join(unknown)}; "
                    f"the datasets are: {', '.join(names)}"
                )
            if phase.dataset_weights:
                w = [phase.dataset_weights.get(n, 0.0) for n in names]
                current = mixture_probs(w, temperature, f"data.phases.{i}.dataset_weights")
            built.append((phase.start_step, current))
        return cls(tuple(names), base, tuple(built))

    def probs_at(self, step: int) -> np.ndarray:
        probs = self.base
        for start, p in self.phases:
            if step >= start:
                probs = p
        return probs

    def weights_at(self, step: int) -> dict[str, float]:
        """The probabilities in force at ``step`` by dataset name (for logs)."""
        return {n: float(p) for n, p in zip(self.names, self.probs_at(step), strict=True)}

    def thresholds_at(self, step: int) -> np.ndarray:
        """Cumulative probabilities as uint64 cut points for 64-bit uniform draws."""
        cum = np.cumsum(self.probs_at(step))[:-1]
        return np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cum], dtype=np.uint64)
