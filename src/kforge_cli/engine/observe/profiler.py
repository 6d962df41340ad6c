"""A torch.profiler window over chosen optimizer steps, one Chrome trace per rank.

Profiling every step would slow training and write gigabytes, so only the steps
``[profiling.start_step, profiling.end_step]`` are recorded (the step before the
window is a warm-up step, so the profiler's own start-up cost stays out of the
trace). The window is keyed to the *optimizer step numbers* the loop reports, not to
how many steps this process has run: a run resumed inside the window records what is
left of it, one resumed past it records nothing. The torch profiler only exists
while the window (or its warm-up step) is running, so steps outside it cost nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from kforge_cli.common.files import atomic_write_via, real_dir
from kforge_cli.engine.observe.logs import get_logger
from kforge_cli.engine.observe.profiler_base import TrainProfiler
from kforge_cli.rundir.layout import RunDir
from kforge_cli.settings.infrastructure import ProfilingSettings

_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


class WindowProfiler(TrainProfiler):
    """Records optimizer steps ``start_step..end_step`` (inclusive) with torch.profiler."""

    enabled = True

    def __init__(
        self,
        *,
        start_step: int,
        end_step: int,
        trace_dir: Path,
        rank: int,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        first_step: int = 1,
    ) -> None:
        super().__init__()
        if end_step < start_step:
            raise ValueError(f"profiler window end_step={end_step} is before start_step={start_step}")
        self._start = max(start_step, 1)
        self._end = end_step
        self._trace_dir = trace_dir
        self._rank = rank
        self._record_shapes = record_shapes
        self._profile_memory = profile_memory
        self._with_stack = with_stack
        self._next_step = first_step
        self._recorded_in_window: list[int] = []
        self._prof: torch.profiler.profile | None = None
        self._done = first_step > self._end
        self._log = get_logger("profiler")
        self._maybe_start()

    def _schedule(self, _torch_step: int) -> ProfilerAction:
        """The action for the optimizer step about to run (torch's own step count is ignored)."""
        n = self._next_step
        if n == self._start - 1:
            return ProfilerAction.WARMUP
        if self._start <= n < self._end:
            return ProfilerAction.RECORD
        if n == self._end:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def _maybe_start(self) -> None:
        if self._prof is not None or self._done or self._schedule(0) == ProfilerAction.NONE:
            return
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            schedule=self._schedule,
            on_trace_ready=self._on_trace_ready,
            record_shapes=self._record_shapes,
            profile_memory=self._profile_memory,
            with_stack=self._with_stack,
        )
        prof.step_num = self._next_step  # label trace steps "ProfilerStep#N" with optimizer step numbers
        prof.__enter__()
        self._prof = prof

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.__exit__(None, None, None)  # stops; a recording window fires _on_trace_ready

    def _on_trace_ready(self, prof: torch.profiler.profile) -> None:
        steps, self._recorded_in_window = self._recorded_in_window, []
        if not steps:  # recorded only steps outside the window (started at the wrong step): nothing to keep
            return
        real_dir(self._trace_dir)  # never a link in the run directory
        path = self._trace_dir / f"rank{self._rank}_step{steps[-1]}.json"
        atomic_write_via(path, lambda tmp: prof.export_chrome_trace(str(tmp)))  # never through a planted link
        self.trace_paths.append(path)
        self._log.info("profiler: wrote steps %d-%d to %s", steps[0], steps[-1], path)

    def step(self, step_number: int) -> None:
        if self._done:
            return
        prof = self._prof
        if prof is not None and prof.current_action in _RECORDING and self._start <= step_number <= self._end:
            self._recorded_in_window.append(step_number)
        self._next_step = step_number + 1
        if step_number >= self._end:
            self._done = True
        if prof is None:
            self._maybe_start()
        elif self._done or self._schedule(0) == ProfilerAction.NONE:
            self._stop()
        else:
            prof.step()

    def close(self) -> None:
        self._stop()
        self._done = True


def build_profiler(
    cfg: ProfilingSettings, run_dir: Path, rank: int, *, first_step: int = 1, device: torch.device | None = None
) -> TrainProfiler:
    """The profiler for this rank: a :class:`WindowProfiler` when enabled, else a no-op; on a CUDA
    `device`, wrapped with the memory snapshots (memory_snapshot.py: the first steps' history when
    ``memory_snapshot_steps`` is set, the allocator's state at an out-of-memory error always).

    ``first_step`` is the optimizer step the loop will run first (a resumed run's
    restored step + 1); it decides whether the window has already begun or passed.
    """
    from kforge_cli.engine.observe.memory_snapshot import with_memory_snapshots

    profiler = _window_profiler(cfg, run_dir, rank, first_step)
    memory = RunDir(run_dir).memory_dir
    return with_memory_snapshots(profiler, cfg, memory, rank, first_step=first_step, device=device)


def _window_profiler(cfg: ProfilingSettings, run_dir: Path, rank: int, first_step: int) -> TrainProfiler:
    if not cfg.enabled:
        return TrainProfiler()
    trace_dir = Path(cfg.trace_dir) if cfg.trace_dir is not None else RunDir(run_dir).profile_dir
    return WindowProfiler(
        start_step=cfg.start_step,
        end_step=cfg.end_step,
        trace_dir=trace_dir,
        rank=rank,
        record_shapes=cfg.record_shapes,
        profile_memory=cfg.profile_memory,
        with_stack=cfg.with_stack,
        first_step=first_step,
    )
