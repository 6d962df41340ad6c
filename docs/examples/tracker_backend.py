"""A tracker backend: every metric point also lands in RUN_DIR/metrics.csv (step, key, value, time).

A backend implements `TrackerBackend` (engine/observe/tracking_types.py): ``name``, ``run_id``,
``start``, ``log_metrics``, ``log_checkpoint``, ``finish``. The tracker fences every call, so a
backend may raise; it buffers and retries, and training never stops for it. Swap it in with the
recipe's tracker phase: ``run_training(settings, tracker=tracker_with_csv)``.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kforge_cli.engine.observe import MetricsFile, Tracker
from kforge_cli.engine.observe.tracker import run_info, tracker_backends
from kforge_cli.engine.observe.tracking_types import CheckpointMark, MetricPoints, RunInfo


class CsvBackend:
    name = "csv"

    def __init__(self, info: RunInfo, run_id: str | None = None) -> None:
        self.path = info.run_dir / "metrics.csv"
        self.run_id: str | None = run_id or self.path.name  # stored in checkpoints: a requeued job appends

    def start(self) -> None:
        if not self.path.exists():
            self.path.write_text("step,key,value,time\n")

    def _append(self, rows: list[tuple[int, str, float, float]]) -> None:
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerows(rows)

    def log_metrics(self, batch: Sequence[MetricPoints]) -> None:
        self._append([(p.step, key, value, p.time) for p in batch for key, value in sorted(p.values.items())])

    def log_checkpoint(self, mark: CheckpointMark) -> None:
        self._append([(mark.step, "checkpoint_step", float(mark.step), mark.time)])

    def finish(self, status: str) -> None:
        pass


def tracker_with_csv(settings: Any, runtime: Any, run_dir: Path, run_ids: Mapping[str, str]) -> Tracker:
    """The recipe's tracker phase: kforge's configured backends plus the CSV one, on rank 0."""
    if not runtime.is_main:
        return Tracker.null()
    info = run_info(settings, Path(run_dir), runtime.world_size)
    backends = [*tracker_backends(settings.metrics, info, run_ids), CsvBackend(info, run_ids.get("csv"))]
    tracker = Tracker(MetricsFile(Path(run_dir) / "metrics.jsonl"), backends)
    tracker.start()
    return tracker
