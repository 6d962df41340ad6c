"""`kforge runs` right after a run ends knows how it ended, and at which step (issue 41).

Exit 0, 75 (Ctrl-C, saved), 130 (Ctrl-C twice) and 137 (kill -9): each read `running` for five
minutes (the recency rule won) and the steps column lagged the checkpoint the run stopped at.
Now the status comes from the run's exit record and its lock, probed without taking it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kforge_cli.cli.runs_table import list_runs
from tests.e2e.test_signals import TINY, _wait_for_step
from tests.helpers.launch import PIPE, Proc, run_kforge, start_kforge, with_repo_path

pytestmark = pytest.mark.e2e


def _rows(root: Path) -> dict[str, tuple[str, int]]:
    r = run_kforge("runs", str(root), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    return {row["name"]: (row["status"], row["steps_done"]) for row in rows}


def _start(root: Path, *extra: str) -> tuple[Proc | subprocess.Popen[str], Path, Path]:
    """`kforge train` of slow steps (tests.helpers.slow_hooks) in root/run; `extra` overrides TINY."""
    root.mkdir()
    run, marker = root / "run", root / "step"
    env = with_repo_path({**os.environ, "KFORGE_TEST_STEP_FILE": str(marker), "OMP_NUM_THREADS": "1"})
    proc = start_kforge(["train", "--run-dir", str(run), *TINY, *extra], env=env, stdout=PIPE, stderr=PIPE)
    return proc, run, marker


def _logged(run: Path) -> int:
    """The last step with a loss in metrics.jsonl (a torn last line skipped)."""
    steps = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return max(steps)


def _newest_checkpoint(run: Path) -> int:
    return max(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*") if (p / "kforge_commit.json").exists())


def test_kforge_runs_right_after_exit_0_75_130_and_137(tmp_path: Path) -> None:
    runs, expected = tmp_path / "runs", {}
    runs.mkdir()
    # 0: a short run to its end.
    env = with_repo_path({"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    r = run_kforge("train", "--run-dir", str(runs / "done"), *TINY, "--train.max_steps=3", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    expected["done"] = ("done", 3)
    # 75: Ctrl-C, the checkpoint saved.
    proc, run, marker = _start(tmp_path / "s")
    _wait_for_step(proc, marker, step=2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 75
    expected["stopped"] = ("stopped (signal)", _newest_checkpoint(run))
    run.rename(runs / "stopped")
    # 130: Ctrl-C twice, within one step: nothing saved.
    proc, run, marker = _start(tmp_path / "i")
    _wait_for_step(proc, marker, step=2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    expected["interrupted"] = ("interrupted", _logged(run))
    run.rename(runs / "interrupted")
    # 137: kill -9 after a periodic checkpoint, mid-run.
    proc, run, marker = _start(tmp_path / "k", "--checkpoint.interval=2")
    _wait_for_step(proc, marker, step=3)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    expected["killed"] = ("killed", max(_logged(run), _newest_checkpoint(run)))
    run.rename(runs / "killed")

    assert _rows(runs) == expected
    assert {row.name: row.status for row in list_runs(runs)} == {k: v[0] for k, v in expected.items()}
