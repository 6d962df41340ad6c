"""Experiment tracking: ``metrics.jsonl`` always, plus W&B, MLflow and/or TensorBoard (rank 0 only).

A job that is preempted and requeued five times must still be ONE run in the tracker,
so :meth:`Tracker.run_ids` reports each backend's run id (the checkpoint stores it) and
:func:`build_tracker` takes the ids back on resume.

A tracker is a convenience; the training run is not. Every backend call goes through a
:class:`_Delivery` fence that never lets an exception reach the training loop: the
first failure warns once, metric points wait in a bounded buffer and are retried at a
later write (after a pause that grows while the failures last, so a black-holed server
costs little training time), and at close the log says how many points never arrived.
The values themselves are safe either way: ``metrics.jsonl`` is written first.

W&B and MLflow are imported lazily by their backends, so importing this module (and
``kforge_cli.engine.observe``) stays cheap.
"""

from __future__ import annotations

import itertools
import logging
import math
import subprocess
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kforge_cli.common.json_values import int_of
from kforge_cli.engine.observe.metrics_file import MetricsFile
from kforge_cli.engine.observe.mlflow_backend import MlflowBackend
from kforge_cli.engine.observe.tracking_types import (
    TRACKER_STATUSES,
    CheckpointMark,
    MetricPoints,
    RunInfo,
    TrackerBackend,
    TrackerStatus,
)
from kforge_cli.engine.observe.wandb_backend import WandbBackend
from kforge_cli.errors import ConfigError
from kforge_cli.rundir.layout import RunDir
from kforge_cli.settings import JobSettings
from kforge_cli.settings.infrastructure import MetricsSettings
from kforge_cli.settings.tracking_check import missing_backend_issues

log = logging.getLogger("kforge")

_NOT_METRICS = frozenset({"step", "time"})
_BATCH_POINTS = 1000  # MLflow's log_batch limit: one backend call per batch, never a partial one


def _as_float(value: object) -> float | None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)  # a 0-d tensor or a numpy scalar
    if callable(item):
        return _as_float(item())
    return None


def metric_points(record: Mapping[str, object], now: float) -> MetricPoints | None:
    """The numeric values of ``record`` as points at ``record["step"]`` (None: nothing to send).

    Strings, booleans and ``None`` are not metrics; NaN and Inf are kept (both trackers
    store them, and a diverging loss is worth seeing).
    """
    if "step" not in record:
        return None
    values = {}
    for key, raw in record.items():
        if key in _NOT_METRICS:
            continue
        value = _as_float(raw)
        if value is not None:
            values[str(key)] = value
    if not values:
        return None
    t = _as_float(record.get("time"))
    return MetricPoints(
        step=int_of(record["step"]), values=values, time=t if t is not None and math.isfinite(t) else now
    )


def git_commit(directory: Path) -> str | None:
    """The commit checked out in ``directory`` (None outside a git repository or without git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) >= 40 else None


def _size(item: MetricPoints | CheckpointMark) -> int:
    return len(item.values) if isinstance(item, MetricPoints) else 1


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class _Delivery:
    """One backend behind a failure fence, with a bounded buffer of points not yet delivered."""

    backend: TrackerBackend
    max_points: int = 100_000
    retry_base_s: float = 2.0
    retry_max_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    queue: deque[MetricPoints | CheckpointMark] = field(default_factory=deque)
    queued_points: int = 0
    dropped_points: int = 0
    delivered_points: int = 0
    started: bool = False
    failures: int = 0  # consecutive failed attempts
    next_try: float = 0.0

    @property
    def name(self) -> str:
        return self.backend.name

    def submit(self, item: MetricPoints | CheckpointMark) -> None:
        self.queue.append(item)
        self.queued_points += _size(item)
        while self.queued_points > self.max_points and len(self.queue) > 1:
            oldest = self.queue.popleft()
            self.queued_points -= _size(oldest)
            if not self.dropped_points:
                log.warning(
                    "%s: buffer full (%d points): dropping the oldest undelivered points", self.name, self.max_points
                )
            self.dropped_points += _size(oldest)
        self.attempt()

    def attempt(self, *, force: bool = False) -> bool:
        """Start the run if needed and send what is buffered; True when nothing is left to send."""
        if not force and self.clock() < self.next_try:
            return False
        backlog = self.queued_points
        try:
            if not self.started:
                self.backend.start()
                self.started = True
            self._flush()
        except Exception as exc:  # a tracker must never stop training
            self._failed(exc)
            return False
        if self.failures:
            log.warning(
                "%s: tracking works again after %d failed attempt(s); delivered %d buffered point(s)",
                self.name,
                self.failures,
                backlog,
            )
        self.failures, self.next_try = 0, 0.0
        return True

    def _flush(self) -> None:
        while self.queue:
            head = self.queue[0]
            if isinstance(head, CheckpointMark):
                self.backend.log_checkpoint(head)
                batch: list[MetricPoints | CheckpointMark] = [head]
            else:
                batch = []
                points = 0
                for item in itertools.takewhile(lambda x: isinstance(x, MetricPoints), self.queue):
                    if batch and points + _size(item) > _BATCH_POINTS:
                        break
                    batch.append(item)
                    points += _size(item)
                self.backend.log_metrics([b for b in batch if isinstance(b, MetricPoints)])
            for item in batch:
                self.queue.popleft()
                self.queued_points -= _size(item)
                self.delivered_points += _size(item)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        delay = min(self.retry_base_s * 2 ** (self.failures - 1), self.retry_max_s)
        self.next_try = self.clock() + delay
        if self.failures == 1:
            log.warning(
                "%s: tracking failed (%s); training continues, metric points are buffered and retried",
                self.name,
                _short(exc),
            )
        else:
            log.debug("%s: attempt %d failed (%s); next in %.0f s", self.name, self.failures, _short(exc), delay)

    def close(self, status: TrackerStatus, *, end_run: bool = True) -> int:
        """Last delivery attempt, then mark the run (unless not `end_run`); returns how many points were not delivered."""
        self.attempt(force=True)
        if self.started and not end_run:  # a reading command added points: the run's status is its trainer's
            detach = getattr(self.backend, "detach", None)
            if detach is not None:
                detach()
        elif self.started:
            try:
                self.backend.finish(status)
            except Exception as exc:
                log.warning("%s: could not mark the run as %s (%s)", self.name, status, _short(exc))
        else:
            log.warning("%s: the run could never be started, so nothing was tracked there", self.name)
        missing = self.queued_points + self.dropped_points
        if missing:
            log.warning(
                "%s: %d metric point(s) were not delivered (%d still buffered at exit, %d dropped from the "
                "full buffer); every value is in metrics.jsonl",
                self.name,
                missing,
                self.queued_points,
                self.dropped_points,
            )
        return missing


class Tracker:
    """Writes metrics.jsonl and forwards the same records to the configured trackers.

    Same ``write(record)`` as :class:`MetricsFile`, so the training loop does not care
    which backends are on. Records with ``eval_loss`` are metrics like any other.
    """

    def __init__(
        self,
        metrics_file: MetricsFile | None,
        backends: Sequence[TrackerBackend] = (),
        *,
        max_points: int = 100_000,
        retry_base_s: float = 2.0,
        retry_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_points`` bounds each backend's buffer; a failed backend is retried after ``retry_base_s``,
        doubling up to ``retry_max_s`` (``clock`` measures it)."""
        self._file = metrics_file  # None: the backends only (the null tracker of ranks other than 0: nowhere)
        self._deliveries = [
            _Delivery(b, max_points=max_points, retry_base_s=retry_base_s, retry_max_s=retry_max_s, clock=clock)
            for b in backends
        ]
        self._closed = False
        self.undelivered: dict[str, int] = {}  # per backend, filled by close()

    @classmethod
    def null(cls) -> Tracker:
        """The tracker of ranks other than 0: same calls, nothing written or sent."""
        return cls(None)

    @property
    def path(self) -> Path | None:
        return self._file.path if self._file is not None else None

    @property
    def backend_names(self) -> list[str]:
        return ["jsonl", *(d.name for d in self._deliveries)]

    def start(self) -> None:
        """Create (or continue) every run now, so it shows up before the first metric."""
        for d in self._deliveries:
            d.attempt(force=True)

    def write(self, record: Mapping[str, object], *, only: Collection[str] | None = None) -> None:
        """Append ``record`` to metrics.jsonl, then hand its numbers to every backend (``only``: to
        the ones named, ``"jsonl"`` for the file). A tracker without a file sends to its backends only
        (the null tracker has none: nothing goes anywhere)."""
        row = dict(record)
        row.setdefault("time", time.time())
        if self._file is not None and (only is None or "jsonl" in only):
            self._file.write(row)
        points = metric_points(row, time.time())
        if points is not None:
            for d in self._deliveries:
                if only is None or d.name in only:
                    d.submit(points)

    def log_checkpoint(self, step: int, path: str) -> None:
        """Record that a checkpoint of ``step`` was saved at ``path`` (metric ``checkpoint_step``)."""
        mark = CheckpointMark(step=int(step), path=str(path), time=time.time())
        for d in self._deliveries:
            d.submit(mark)

    def run_ids(self) -> dict[str, str]:
        """Backend name -> run id, for the checkpoint (a requeued job continues these runs)."""
        return {d.name: d.backend.run_id for d in self._deliveries if d.backend.run_id}

    def close(self, status: TrackerStatus, *, end_runs: bool = True) -> None:
        """Deliver what is left, mark each run completed/stopped/failed, close the file. Idempotent.

        ``end_runs=False`` (``kforge eval --track``) delivers without marking any run: only the
        run's own training process ends its tracked runs.
        """
        if status not in TRACKER_STATUSES:
            raise ValueError(f"tracker status {status!r} is not one of {TRACKER_STATUSES}")
        if self._closed:
            return
        self._closed = True
        try:
            for d in self._deliveries:
                self.undelivered[d.name] = d.close(status, end_run=end_runs)
        finally:
            if self._file is not None:
                self._file.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """A fallback for exits that did not call close(): an exception is a failure, Ctrl-C a stop."""
        if exc_type is None:
            self.close("completed")
        else:
            self.close("stopped" if issubclass(exc_type, KeyboardInterrupt) else "failed")


def run_info(settings: JobSettings, run_dir: Path, world_size: int) -> RunInfo:
    m = settings.metrics
    return RunInfo(
        name=m.run_name or run_dir.name,
        tags=list(m.tags),
        profile=settings.profile,
        world_size=world_size,
        git_commit=git_commit(Path.cwd()),
        run_dir=run_dir,
        config=settings.model_dump(mode="json"),
        config_path=RunDir(run_dir).config,
    )


def tracker_backends(m: MetricsSettings, info: RunInfo, run_ids: Mapping[str, str]) -> list[TrackerBackend]:
    """The backends that the ``metrics`` section ``m`` names, not started yet, each told which run
    (if any) to continue.

    Per backend that is ``metrics.<backend>_run_id`` when set (an explicit request),
    else the id restored from the checkpoint (``run_ids``), else none: a new run.
    """
    missing = missing_backend_issues(m)
    if missing:  # settings validation says so first; this covers settings built without it
        raise ConfigError(missing, header="a configured tracker's package is not installed")
    backends: list[TrackerBackend] = []
    if "wandb" in m.backends:
        backends.append(WandbBackend(m, info, run_id=m.wandb_run_id or run_ids.get("wandb")))
    if "mlflow" in m.backends:
        backends.append(MlflowBackend(m, info, run_id=m.mlflow_run_id or run_ids.get("mlflow")))
    if "tensorboard" in m.backends:
        from kforge_cli.engine.observe.tensorboard_backend import TensorboardBackend

        backends.append(TensorboardBackend(info, run_id=run_ids.get("tensorboard")))
    return backends


def build_tracker(
    settings: JobSettings,
    *,
    is_main: bool,
    run_dir: Path,
    world_size: int,
    run_ids: Mapping[str, str] | None = None,
) -> Tracker:
    """The run's tracker on rank 0 (the null tracker elsewhere), with every backend's run already started.

    ``run_ids`` are the ids the checkpoint stored (``Tracker.run_ids`` of the earlier
    job), so a requeued job continues the same runs.
    """
    if not is_main:
        return Tracker.null()
    run_dir = Path(run_dir)
    wanted = set(settings.metrics.backends) - {"jsonl"}
    backends = (
        tracker_backends(settings.metrics, run_info(settings, run_dir, world_size), run_ids or {}) if wanted else []
    )
    tracker = Tracker(MetricsFile(RunDir(run_dir).metrics), backends)
    tracker.start()
    return tracker
