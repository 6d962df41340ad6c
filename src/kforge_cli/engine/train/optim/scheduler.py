"""Learning-rate schedules: warmup, then cosine / linear / WSD / constant / REX, times the data phase's lr_scale.

Convention (shared by the loop, the checkpoint and the tests): ``step`` is the 0-based
index of the optimizer update about to be applied. :func:`build_scheduler` returns a
``LambdaLR`` whose construction already sets the LR of update 0; the training loop
calls ``scheduler.step()`` once after every optimizer step (a step skipped because of a
NaN included), so update ``k`` always runs with ``lr * lr_multiplier(k) *
phase_lr_scale(k)`` and the scheduler never drifts from the step counter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR

from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings.data import DataPhase
from kforge_cli.settings.training import SchedulerSettings

WSD_DEFAULT_COOLDOWN_FRACTION = 0.2


def _decay_shape(shape: str, progress: float, min_ratio: float) -> float:
    """Multiplier at ``progress`` in [0, 1] of a decay from 1 to ``min_ratio``."""
    if shape == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "linear":
        return 1.0 - progress * (1.0 - min_ratio)
    if shape == "sqrt":
        return 1.0 - math.sqrt(progress) * (1.0 - min_ratio)
    if shape == "rex":
        remaining = 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * remaining / (0.5 + 0.5 * remaining)
    raise ValueError(f"unknown decay shape {shape!r}")


def _progress(step: int, start: int, length: int) -> float:
    """Fraction of a decay of ``length`` steps starting at ``start``, clipped to [0, 1] (1 if empty)."""
    if length <= 0:
        return 1.0
    return min(1.0, max(0.0, (step - start) / length))


def wsd_cooldown_steps(sched: SchedulerSettings, max_steps: int) -> int:
    """Length of the WSD cooldown: ``decay_steps``, or 20% of ``max_steps`` when unset."""
    if sched.decay_steps is not None:
        return sched.decay_steps
    return int(WSD_DEFAULT_COOLDOWN_FRACTION * max_steps)


def lr_multiplier(step: int, sched: SchedulerSettings, max_steps: int) -> float:
    """The factor on the peak LR for update ``step`` (0-based index of the update about to be applied).

    - warmup (``step < warmup_steps``): ``(step + 1) / warmup_steps``, so the first
      update already moves the weights and update ``warmup_steps - 1`` runs at the peak;
    - then ``p = (step - warmup_steps) / decay_steps`` clipped to [0, 1], with
      ``decay_steps = max_steps - warmup_steps`` when unset; the floor ``min_lr_ratio``
      is reached at ``step = warmup_steps + decay_steps`` (one past the last update when
      decay_steps is unset):
      cosine ``min + (1-min) * (1 + cos(pi p)) / 2``; linear ``1 - p (1-min)``;
      rex ``min + (1-min) (1-p) / (0.5 + 0.5 (1-p))``; constant ``1``;
    - wsd: ``1`` until ``max_steps - decay_steps`` (``decay_steps`` unset = 20% of
      ``max_steps``), then a cooldown over ``decay_steps`` shaped by ``wsd_cooldown``
      (linear and cosine as above, sqrt ``1 - sqrt(p) (1-min)``).
    """
    warmup = sched.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    min_ratio = sched.min_lr_ratio
    if sched.name == "constant":
        return 1.0
    if sched.name == "wsd":
        cooldown = wsd_cooldown_steps(sched, max_steps)
        start = max_steps - cooldown
        if cooldown <= 0 or step < start:
            return 1.0
        return _decay_shape(sched.wsd_cooldown, _progress(step, start, cooldown), min_ratio)
    length = sched.decay_steps if sched.decay_steps is not None else max_steps - warmup
    return _decay_shape(sched.name, _progress(step, warmup, length), min_ratio)


def phase_lr_scale(step: int, phases: Sequence[DataPhase]) -> float:
    """``lr_scale`` of the last data phase with ``start_step <= step`` (1.0 before the first)."""
    scale = 1.0
    for phase in sorted(phases, key=lambda p: p.start_step):
        if phase.start_step <= step:
            scale = phase.lr_scale
    return scale


def _check(cfg: SchedulerSettings) -> None:
    """Reject settings no schedule can honour (normally caught earlier by validate-config)."""
    decay_steps = cfg.decay_steps
    if decay_steps is not None and decay_steps < 0:
        raise ConfigError([ConfigIssue("scheduler.decay_steps", f"{decay_steps} must be >= 0 (or unset)")])


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: SchedulerSettings,
    max_steps: int,
    phases: Sequence[DataPhase] = (),
) -> LambdaLR:
    """A ``LambdaLR`` applying ``lr_multiplier * phase_lr_scale`` to each group's own initial LR.

    ``cfg`` is the ``scheduler`` section, ``max_steps`` the run's ``train.max_steps`` and
    ``phases`` its ``data.phases`` (each may scale the LR from its start step). Each param
    group keeps its own peak (Muon's ``muon_lr`` and AdamW's ``lr`` both follow the schedule).
    The lambda is a plain closure, so ``state_dict()`` holds only numbers and lists
    (JSON-serialisable) and the schedule itself is rebuilt from the settings on resume.
    """
    _check(cfg)
    sched = cfg.model_copy()
    phases = [p.model_copy() for p in phases]

    def multiplier(step: int) -> float:
        return lr_multiplier(step, sched, max_steps) * phase_lr_scale(step, phases)

    return LambdaLR(optimizer, multiplier)
