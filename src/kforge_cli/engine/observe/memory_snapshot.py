"""CUDA memory snapshots: the allocator's history over a run's first steps, and its state at an OOM.

``profiling.memory_snapshot_steps = N`` records every CUDA allocation and free, with its
Python stack, from the start of training to the end of the N-th step this process runs
(``profiling.memory_snapshot_max_entries`` events at most; older ones are dropped), then
writes ``RUN_DIR/memory/rank<R>_steps<A>-<B>.pickle`` and stops recording. A run that ends
inside those steps still writes what it recorded. Open the file at
https://pytorch.org/memory_viz (PyTorch's memory viz: the allocation timeline, and the
allocator's segments at the end of the window).

On every CUDA run, an out-of-memory error writes the allocator's state at that moment to
``RUN_DIR/memory/rank<R>_oom.pickle`` (with the allocations' stacks only while the history
is being recorded), and the error message names the file. The file is written from torch's
out-of-memory observer, before the error unwinds the step and frees its tensors.

Files are written through :func:`kforge_cli.common.files.atomic_write_via` (never through a link).
The recording functions are PyTorch's ``torch.cuda.memory._record_memory_history`` and
``_dump_snapshot``: underscored, but the documented way to produce these files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kforge_cli.common.files import atomic_write_via, real_dir
from kforge_cli.engine.observe.logs import get_logger
from kforge_cli.engine.observe.profiler_base import TrainProfiler
from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.rundir.names import MEMORY_OOM_FILE, MEMORY_STEPS_FILE
from kforge_cli.settings.infrastructure import ProfilingSettings

NOT_ON_CPU = (
    "records the CUDA allocator's history, and this run trains on the CPU (no CUDA device): set it to 0, "
    "or train on a GPU"
)

_log = get_logger("memory")


def refuse_on_cpu() -> ConfigError:
    return ConfigError([ConfigIssue("profiling.memory_snapshot_steps", NOT_ON_CPU)])


def dump_snapshot(path: Path) -> Path:
    """The CUDA allocator's snapshot (with the recorded history, if any) written to `path` safely."""
    real_dir(path.parent)
    atomic_write_via(path, lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))
    return path


class _OomWatch:
    """Where the out-of-memory observer writes (one observer per process: torch cannot detach one)."""

    attached = False
    target: tuple[Path, int] | None = None  # (memory dir, rank) while a run is training
    written: Path | None = None  # the snapshot of the last OOM of the current (or last) run


def _on_oom(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    target, _OomWatch.target = _OomWatch.target, None  # the first OOM of a run only
    if target is None:
        return
    directory, rank = target
    try:
        _OomWatch.written = dump_snapshot(directory / MEMORY_OOM_FILE.format(rank=rank))
    except Exception as exc:  # never mask the out-of-memory error itself
        _log.warning("memory snapshot at the out-of-memory error not written: %s", exc)


def watch_oom(directory: Path, rank: int) -> None:
    """From now until :func:`unwatch_oom`, an out-of-memory error writes the allocator's state."""
    _OomWatch.target, _OomWatch.written = (directory, rank), None
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if not _OomWatch.attached and attach is not None:
        attach(_on_oom)
        _OomWatch.attached = True


def unwatch_oom() -> None:
    _OomWatch.target = None


def oom_snapshot_path() -> Path | None:
    """The allocator snapshot written at this process's last out-of-memory error in training, if any."""
    return _OomWatch.written


class MemorySnapshots(TrainProfiler):
    """The run's profiler with CUDA memory snapshots: steps and close pass through to `inner`."""

    def __init__(
        self, inner: TrainProfiler, *, steps: int, max_entries: int, directory: Path, rank: int, first_step: int
    ) -> None:
        super().__init__()
        self.inner = inner
        self.enabled = inner.enabled
        self.trace_paths = inner.trace_paths
        self.snapshot_paths: list[Path] = []
        self._directory, self._rank = directory, rank
        self._first, self._last = first_step, first_step + steps - 1
        self._seen: int | None = None
        self._recording = steps > 0
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=max_entries)
        watch_oom(directory, rank)

    def _finish(self) -> None:
        if not self._recording:
            return
        self._recording = False
        try:
            if self._seen is not None:
                name = MEMORY_STEPS_FILE.format(rank=self._rank, first=self._first, last=self._seen)
                path = dump_snapshot(self._directory / name)
                self.snapshot_paths.append(path)
                _log.info(
                    "memory snapshot of steps %d-%d: %s (open it at https://pytorch.org/memory_viz)",
                    self._first,
                    self._seen,
                    path,
                )
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def step(self, step_number: int) -> None:
        self.inner.step(step_number)
        self._seen = step_number
        if step_number >= self._last:
            self._finish()

    def close(self) -> None:
        try:
            self.inner.close()
            self._finish()
        finally:
            unwatch_oom()


def with_memory_snapshots(
    profiler: TrainProfiler,
    cfg: ProfilingSettings,
    directory: Path,
    rank: int,
    *,
    first_step: int,
    device: torch.device | None,
) -> TrainProfiler:
    """`profiler` with the memory snapshots of `cfg` on a CUDA `device`; on another device the
    setting is refused (exit 2) and `profiler` is returned as it is when the setting is off."""
    if device is None or device.type != "cuda":
        if cfg.memory_snapshot_steps:
            raise refuse_on_cpu()
        return profiler
    return MemorySnapshots(
        profiler,
        steps=cfg.memory_snapshot_steps,
        max_entries=cfg.memory_snapshot_max_entries,
        directory=directory,
        rank=rank,
        first_step=first_step,
    )
