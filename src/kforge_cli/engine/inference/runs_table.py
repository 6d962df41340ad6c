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

from kforge_cli.engine.checkpoint.layout import SUMMARY_FILE, newest_complete
from kforge_cli.engine.observe.metrics_file import tail_records
from kforge_cli.errors import InvalidInputError, KforgeError
from kforge_cli.files import read_text_capped


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


MAX_CONFIG_BYTES = 1 << 20  # a kforge config.toml is a few KB


def _config(run_dir: Path) -> dict[str, Any]:
    """The run's config.toml, or {} when it is missing or not one (a FIFO, huge, not TOML, nested too deep)."""
    try:
        return tomllib.loads(read_text_capped(run_dir / "config.toml", MAX_CONFIG_BYTES, "config"))
    except (OSError, KforgeError, tomllib.TOMLDecodeError, RecursionError, ValueError):
        return {}


def _last_values(path: Path, keys: tuple[str, ...]) -> dict[str, tuple[int, float]]:
    """For each key, (step, value) of the last record holding it as a number, from the file's tail only
    (``metrics_file.tail_records``: the same cost for any file size)."""
    last: dict[str, tuple[int, float]] = {}
    try:
        for record in tail_records(path):
            step = record.get("step")
            if not isinstance(step, int):
                continue
            for key in keys:
                value = record.get(key)
                if key not in last and isinstance(value, int | float) and not isinstance(value, bool):
                    last[key] = (step, float(value))
            if len(last) == len(keys):
                break
    except (OSError, KforgeError):  # unreadable, a FIFO: the row shows no metrics
        return {}
    return last


def _mtime(run_dir: Path) -> float | None:
    candidates = [run_dir / "metrics.jsonl", *sorted((run_dir / "logs").glob("*"))]
    times = [p.stat().st_mtime for p in candidates if p.is_file()]
    return max(times) if times else None


def describe_run(run_dir: Path, *, now: float | None = None, active_s: float = 300.0) -> RunRow:
    now = time.time() if now is None else now
    config = _config(run_dir)
    planned = config.get("train", {}).get("max_steps")
    metrics = run_dir / "metrics.jsonl"
    last = _last_values(metrics, ("loss", "eval_loss")) if metrics.is_file() else {}
    step, loss = last.get("loss", (None, None))
    eval_loss = last.get("eval_loss", (None, None))[1]
    latest, _ = newest_complete(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else (None, [])
    reason = None
    if latest is not None:
        try:
            reason = json.loads(read_text_capped(latest / SUMMARY_FILE, MAX_CONFIG_BYTES, "summary")).get("reason")
        except (OSError, ValueError, RecursionError, AttributeError, KforgeError):
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
