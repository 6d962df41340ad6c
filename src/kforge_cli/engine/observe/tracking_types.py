"""What the tracker and its backends exchange: metric points, checkpoint marks, run info, the backend
protocol. Its own module so that the backends (W&B, MLflow) and the tracker import it, not each other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, get_args

TrackerStatus = Literal["completed", "stopped", "failed"]
TRACKER_STATUSES: tuple[str, ...] = get_args(TrackerStatus)


@dataclass(frozen=True)
class MetricPoints:
    """The scalar metrics of one ``metrics.jsonl`` record: one point per key at ``step``."""

    step: int
    values: dict[str, float]
    time: float  # unix seconds


@dataclass(frozen=True)
class CheckpointMark:
    """A checkpoint saved at ``step`` (counts as one metric point: ``checkpoint_step``)."""

    step: int
    path: str
    time: float


@dataclass(frozen=True)
class RunInfo:
    """What every backend needs to describe the run, computed once by :func:`build_tracker`."""

    name: str
    tags: list[str]
    profile: str | None
    world_size: int
    git_commit: str | None
    run_dir: Path
    config: dict[str, object]  # the resolved settings, JSON-compatible
    config_path: Path  # RUN_DIR/config.toml


class TrackerBackend(Protocol):
    """One experiment tracker. Any method may raise: the caller fences it."""

    name: str
    run_id: str | None  # the run to continue before start(); the run's id once known

    def start(self) -> None:
        """Create the run or continue ``run_id``; log config, params and tags. Safe to call again."""
        ...

    def log_metrics(self, batch: Sequence[MetricPoints]) -> None: ...

    def log_checkpoint(self, mark: CheckpointMark) -> None: ...

    def finish(self, status: TrackerStatus) -> None: ...
