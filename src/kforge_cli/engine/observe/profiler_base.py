"""The profiler API the loop calls (the disabled profiler), shared by the window profiler and the
memory snapshots that wrap it."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType


class TrainProfiler:
    """The profiler API the loop calls; this base class is the disabled, do-nothing profiler."""

    enabled: bool = False

    def __init__(self) -> None:
        self.trace_paths: list[Path] = []

    def step(self, step_number: int) -> None:
        """Call once after each optimizer step with its 1-based number."""

    def close(self) -> None:
        """Stop profiling; a window cut short (the run ended inside it) is still written."""

    def __enter__(self) -> TrainProfiler:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
