"""`kforge runs` (status per run); `kforge plot` is in test_plot.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kforge_cli.cli.runs_table import list_runs
from kforge_cli.rundir.names import COMMIT_FILE, DCP_METADATA, SUMMARY_FILE


def _train(step: int, loss: float) -> dict[str, float]:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3 * step,
        "grad_norm": 1.0 / step,
        "tokens_seen": 64 * step,
        "tokens_per_sec": 500.0,
    }


def _run(root: Path, name: str, records: list[dict], max_steps: int, checkpoint: tuple[int, str] | None = None) -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "config.toml").write_text(f'profile = "cpu-debug"\n[train]\nmax_steps = {max_steps}\n')
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if checkpoint is not None:
        step_dir = run / "checkpoints" / f"step_{checkpoint[0]}"
        step_dir.mkdir(parents=True)
        (step_dir / DCP_METADATA).write_bytes(b"")
        (step_dir / COMMIT_FILE).write_text(json.dumps({"step": checkpoint[0]}))
        (step_dir / SUMMARY_FILE).write_text(json.dumps({"step": checkpoint[0], "reason": checkpoint[1]}))
    return run


def _requeued() -> list[dict]:
    """Steps 1..6, killed; the requeued job resumes from the step-4 checkpoint and logs 5..8 again."""
    first = [_train(s, 5.0 - 0.1 * s) for s in range(1, 7)]
    second = [_train(s, 4.0 - 0.1 * s) for s in range(5, 9)]
    return [*first, {"step": 4, "eval_loss": 4.5}, *second, {"step": 8, "eval_loss": 3.5}]


def test_runs_table_statuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = time.time() - 3600
    done = _run(tmp_path, "done", [_train(s, 3.0) for s in range(1, 5)], 4, (4, "final"))
    stopped = _run(tmp_path, "stopped", [_train(s, 3.0) for s in range(1, 3)], 4, (2, "signal"))
    failed = _run(tmp_path, "failed", [_train(1, 3.0)], 4)
    _run(tmp_path, "live", [_train(1, 2.5), {"step": 1, "eval_loss": 2.75}], 4)
    for run in (done, stopped, failed):
        for f in (run / "metrics.jsonl", run / "config.toml"):
            os.utime(f, (old, old))
    rows = {r.name: r for r in list_runs(tmp_path)}
    assert {n: r.status for n, r in rows.items()} == {
        "done": "done",
        "stopped": "stopped (signal)",
        "failed": "failed",
        "live": "running",
    }
    assert (rows["stopped"].steps_done, rows["stopped"].steps_planned, rows["stopped"].latest_checkpoint) == (
        2,
        4,
        "step_2",
    )
    assert rows["live"].last_loss == 2.5 and rows["live"].eval_loss == 2.75 and rows["live"].profile == "cpu-debug"
    from kforge_cli.cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(["runs", str(tmp_path)])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "profile", "steps", "loss", "eval_loss", "checkpoint", "status", "updated"]
    assert lines[1].split()[:7] == ["live", "cpu-debug", "1/4", "2.5000", "2.7500", "-", "running"]
