"""`kforge runs`: one row per run directory, read from files only (config, metrics, checkpoints).

Status: ``completed`` (the final checkpoint was written, or the planned steps were
logged), ``running`` (otherwise, and metrics.jsonl or a log changed within
``active_s`` seconds), ``stopped`` (the newest checkpoint was saved on a signal: requeue
or resume it), ``failed`` (none of these: it ended without a final checkpoint).
"""

from __future__ import annotations

import json
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kforge_cli.engine.observe.metrics_file import read_metrics
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.checkpoints import newest_complete
from kforge_cli.rundir.names import SUMMARY_FILE


@dataclass
class RunRow:
    name: str
    profile: str | None
    steps_done: int | None
    steps_planned: int | None
    last_loss: float | None
    eval_loss: float | None
    latest_checkpoint: str | None
    status: str
    last_update: str | None
    path: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _config(run_dir: Path) -> dict[str, Any]:
    try:
        return tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _last(records: list[dict[str, Any]], key: str) -> tuple[int | None, float | None]:
    for record in reversed(records):
        if isinstance(record.get(key), int | float) and isinstance(record.get("step"), int):
            return record["step"], float(record[key])
    return None, None


def _mtime(run_dir: Path) -> float | None:
    candidates = [run_dir / "metrics.jsonl", *sorted((run_dir / "logs").glob("*"))]
    times = [p.stat().st_mtime for p in candidates if p.is_file()]
    return max(times) if times else None


def describe_run(run_dir: Path, *, now: float | None = None, active_s: float = 300.0) -> RunRow:
    now = time.time() if now is None else now
    config = _config(run_dir)
    planned = config.get("train", {}).get("max_steps")
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    step, loss = _last(records, "loss")
    _, eval_loss = _last(records, "eval_loss")
    latest, _ = newest_complete(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else (None, [])
    reason = None
    if latest is not None:
        try:
            reason = json.loads((latest / SUMMARY_FILE).read_text()).get("reason")
        except (OSError, json.JSONDecodeError, AttributeError):
            reason = None
    mtime = _mtime(run_dir)
    if reason == "final" or (isinstance(planned, int) and step is not None and step >= planned):
        status = "completed"
    elif mtime is not None and now - mtime < active_s:
        status = "running"
    elif reason == "signal":
        status = "stopped"
    else:
        status = "failed"
    return RunRow(
        name=run_dir.name,
        profile=config.get("profile") or None,
        steps_done=step,
        steps_planned=planned if isinstance(planned, int) else None,
        last_loss=loss,
        eval_loss=eval_loss,
        latest_checkpoint=latest.name if latest is not None else None,
        status=status,
        last_update=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime)) if mtime else None,
        path=str(run_dir),
    )


def list_runs(root: Path, *, active_s: float = 300.0) -> list[RunRow]:
    """Every run directory (one with config.toml or metrics.jsonl) directly under `root`, newest first."""
    if not root.is_dir():
        raise InvalidInputError(f"{root} is not a directory; give the folder that holds your run directories")
    dirs = [
        d for d in root.iterdir() if d.is_dir() and ((d / "config.toml").is_file() or (d / "metrics.jsonl").is_file())
    ]
    rows = [describe_run(d, active_s=active_s) for d in dirs]
    return sorted(rows, key=lambda r: r.last_update or "", reverse=True)
