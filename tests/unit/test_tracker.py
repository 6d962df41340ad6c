"""engine.observe.tracker: jsonl + backends, the failure fence (warn once, buffer, retry, count), close.

The backend here is an in-process implementation of the `TrackerBackend` protocol that
can be told to fail, so the fence's bookkeeping can be checked exactly. The real W&B
and MLflow backends are tested in test_tracker_mlflow.py and tests/e2e/test_tracking_*.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kforge_cli.engine.observe import MetricsFile, Tracker, build_tracker, read_metrics
from kforge_cli.engine.observe.tracker import (
    CheckpointMark,
    MetricPoints,
    RunInfo,
    metric_points,
    tracker_backends,
)
from kforge_cli.settings import JobSettings


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def logs() -> Iterator[Recorder]:
    logger = logging.getLogger("kforge")
    handler, old_level = Recorder(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


class FakeBackend:
    """Implements TrackerBackend; fails every call while `failing` is True."""

    name = "fake"

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id
        self.failing = False
        self.fail_finish = False
        self.starts = 0
        self.calls: list[tuple[str, Any]] = []

    def _check(self) -> None:
        if self.failing:
            raise ConnectionError("server down")

    def start(self) -> None:
        self.starts += 1
        self._check()
        self.run_id = self.run_id or "run-1"

    def log_metrics(self, batch: Sequence[MetricPoints]) -> None:
        self._check()
        self.calls.append(("metrics", list(batch)))

    def log_checkpoint(self, mark: CheckpointMark) -> None:
        self._check()
        self.calls.append(("checkpoint", mark))

    def finish(self, status: str) -> None:
        if self.fail_finish:
            raise ConnectionError("server down at the end")
        self.calls.append(("finish", status))

    def delivered(self) -> list[tuple[int, dict[str, float]]]:
        return [(p.step, p.values) for kind, batch in self.calls if kind == "metrics" for p in batch]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, backend: FakeBackend, **fence: Any) -> Tracker:
    return Tracker(MetricsFile(tmp_path / "metrics.jsonl"), [backend], **fence)


def record(step: int, n: int = 2) -> dict[str, Any]:
    return {"step": step, **{f"m{i}": float(step * 10 + i) for i in range(n)}}


def test_metric_points_keep_numbers_only() -> None:
    rec = {
        "step": 3,
        "loss": 1.5,
        "lr": torch.tensor(0.25),
        "tokens_seen": 100,
        "skipped": True,
        "note": "x",
        "mfu": None,
        "bad": float("nan"),
        "time": 12.0,
    }
    points = metric_points(rec, now=99.0)
    assert points is not None and points.step == 3 and points.time == 12.0
    assert set(points.values) == {"loss", "lr", "tokens_seen", "bad"}
    assert points.values["loss"] == 1.5 and points.values["lr"] == 0.25 and points.values["tokens_seen"] == 100.0
    assert math.isnan(points.values["bad"])
    assert metric_points({"loss": 1.0}, now=0.0) is None  # no step
    assert metric_points({"step": 1, "time": 5.0}, now=0.0) is None  # nothing to send
    eval_points = metric_points({"step": 4, "eval_loss": 2.0}, now=7.0)
    assert eval_points == MetricPoints(4, {"eval_loss": 2.0}, 7.0)


def test_jsonl_only_tracker_writes_metrics_file(tmp_path: Path) -> None:
    settings = JobSettings()
    other_rank = build_tracker(settings, is_main=False, run_dir=tmp_path / "other", world_size=2)
    other_rank.write({"step": 1, "loss": 2.5})  # the null tracker: same calls, nothing written
    other_rank.close("completed")
    assert other_rank.path is None and other_rank.run_ids() == {} and not (tmp_path / "other").exists()
    tracker = build_tracker(settings, is_main=True, run_dir=tmp_path, world_size=1)
    assert tracker is not None and tracker.backend_names == ["jsonl"] and tracker.run_ids() == {}
    tracker.write({"step": 1, "loss": 2.5, "time": 10.0})
    tracker.write({"step": 1, "eval_loss": 3.0})
    tracker.close("completed")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0] == {"step": 1, "loss": 2.5, "time": 10.0}
    assert rows[1]["eval_loss"] == 3.0 and isinstance(rows[1]["time"], float)
    with pytest.raises(RuntimeError):
        tracker.write({"step": 2, "loss": 1.0})


def test_explicit_run_id_setting_wins_over_the_checkpoint(tmp_path: Path) -> None:
    settings = JobSettings()
    settings.metrics.backends = ["jsonl", "wandb", "mlflow"]
    settings.metrics.mlflow_tracking_uri = f"sqlite:///{tmp_path / 'm.db'}"
    settings.metrics.wandb_run_id = "explicit"
    info = RunInfo("r", [], None, 1, None, tmp_path, {}, tmp_path / "config.toml")
    wandb, mlflow = tracker_backends(settings.metrics, info, {"wandb": "fromckpt", "mlflow": "ml-from-ckpt"})
    assert (wandb.name, wandb.run_id) == ("wandb", "explicit")
    assert (mlflow.name, mlflow.run_id) == ("mlflow", "ml-from-ckpt")
    settings.metrics.wandb_run_id = None
    fresh_wandb, fresh_mlflow = tracker_backends(settings.metrics, info, {})
    assert fresh_mlflow.run_id is None  # MLflow's server assigns it
    assert fresh_wandb.run_id is not None and len(fresh_wandb.run_id) == 8  # chosen before wandb.init


def test_failure_warns_once_buffers_and_delivers_in_order_after_recovery(tmp_path: Path, logs: Recorder) -> None:
    backend, clock = FakeBackend(), Clock()
    backend.failing = True
    tracker = make(tmp_path, backend, clock=clock, retry_base_s=2.0)
    tracker.start()
    for step in (1, 2, 3):
        clock.now += 100.0  # every write is past the backoff: each one retries
        tracker.write(record(step))
    assert backend.starts == 4 and backend.calls == []
    failures = [m for m in logs.messages() if "tracking failed" in m]
    assert len(failures) == 1 and "ConnectionError: server down" in failures[0]
    backend.failing = False
    clock.now += 100.0
    tracker.write(record(4))
    assert backend.delivered() == [(s, {"m0": s * 10.0, "m1": s * 10.0 + 1}) for s in (1, 2, 3, 4)]
    assert any("works again after 4 failed attempt(s); delivered 8 buffered point(s)" in m for m in logs.messages())
    tracker.close("completed")
    assert backend.calls[-1] == ("finish", "completed") and tracker.undelivered == {"fake": 0}
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4  # jsonl got everything regardless


def test_backoff_doubles_and_skips_attempts_until_due(tmp_path: Path) -> None:
    backend, clock = FakeBackend(), Clock()
    backend.failing = True
    tracker = make(tmp_path, backend, clock=clock, retry_base_s=2.0, retry_max_s=5.0)
    tracker.start()  # t=0: attempt 1 fails, next at t=2
    attempts = []
    for t in (1.0, 2.0, 3.0, 5.9, 6.0, 10.0, 11.0):
        clock.now = t
        tracker.write(record(int(t)))
        attempts.append(backend.starts)
    # t=2 fails (next at 2+4=6), t=6 fails (next at 6+min(8,5)=11), t=11 retries.
    assert attempts == [1, 2, 2, 2, 3, 3, 4]


def test_full_buffer_drops_oldest_and_close_reports_the_count(tmp_path: Path, logs: Recorder) -> None:
    backend = FakeBackend()
    backend.failing = True
    tracker = make(tmp_path, backend, max_points=5, retry_base_s=1e9)
    tracker.start()
    for step in (1, 2, 3, 4):
        tracker.write(record(step))  # 2 points each
    tracker.close("failed")
    assert tracker.undelivered == {"fake": 8}
    assert backend.calls == []  # never started, so never marked
    text = "\n".join(logs.messages())
    assert "8 metric point(s) were not delivered (4 still buffered at exit, 4 dropped from the full buffer)" in text
    assert "could never be started" in text and "buffer full (5 points)" in text
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4


def test_checkpoint_marks_keep_their_place_among_metrics(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.failing = True
    tracker = make(tmp_path, backend, retry_base_s=0.0)
    tracker.write(record(1))
    tracker.log_checkpoint(1, "/ckpt/step_1")
    tracker.write(record(2))
    backend.failing = False
    tracker.close("stopped")
    kinds = [
        (kind, [p.step for p in arg] if kind == "metrics" else getattr(arg, "step", arg)) for kind, arg in backend.calls
    ]
    assert kinds == [("metrics", [1]), ("checkpoint", 1), ("metrics", [2]), ("finish", "stopped")]
    assert backend.calls[1][1].path == "/ckpt/step_1"


def test_buffered_points_go_out_in_batches_of_at_most_1000(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.failing = True
    tracker = make(tmp_path, backend, retry_base_s=0.0)
    for step, n in ((1, 600), (2, 300), (3, 300), (4, 1200), (5, 10)):
        tracker.write(record(step, n))
    backend.failing = False
    tracker.close("completed")
    sizes = [sum(len(p.values) for p in batch) for kind, batch in backend.calls if kind == "metrics"]
    assert sizes == [900, 300, 1200, 10]  # a record larger than the limit goes alone, never split


def test_close_is_idempotent_validates_status_and_survives_a_failing_finish(tmp_path: Path, logs: Recorder) -> None:
    backend = FakeBackend("given")
    tracker = make(tmp_path, backend)
    tracker.start()
    assert tracker.run_ids() == {"fake": "given"}
    with pytest.raises(ValueError, match="not one of"):
        tracker.close("done")  # type: ignore[arg-type]
    backend.fail_finish = True
    tracker.close("stopped")
    tracker.close("failed")
    assert backend.calls == []
    assert any("could not mark the run as stopped" in m for m in logs.messages())


@pytest.mark.parametrize(("exc", "status"), [(KeyboardInterrupt, "stopped"), (RuntimeError, "failed")])
def test_exiting_on_an_exception_marks_the_run(tmp_path: Path, exc: type[BaseException], status: str) -> None:
    backend = FakeBackend()
    with pytest.raises(exc), make(tmp_path, backend) as tracker:
        tracker.write(record(1))
        raise exc()
    assert backend.calls[-1] == ("finish", status)
