"""Ctrl-C and SIGTERM on a running `kforge train` (one process and `--nproc-per-node 2`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import tiny
from tests.helpers.launch import PIPE, Proc, start_kforge, with_repo_path

pytestmark = pytest.mark.e2e

TINY = [
    *tiny.model(32, 2, 2, 1),
    "--train.batch_size=2",
    "--train.seq_len=32",
    "--train.max_steps=1000",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    *tiny.ONE_THREAD,
    '--train.hooks=["tests.helpers.slow_hooks:SlowSteps"]',
]


def _start(tmp_path: Path, *extra: str) -> tuple[Proc | subprocess.Popen[str], Path, Path]:
    run, marker = tmp_path / "run", tmp_path / "step"
    env = with_repo_path({**os.environ, "KFORGE_TEST_STEP_FILE": str(marker), "OMP_NUM_THREADS": "1"})
    proc = start_kforge(["train", *extra, "--run-dir", str(run), *TINY], env=env, stdout=PIPE, stderr=PIPE)
    return proc, run, marker


def _reached(marker: Path, rank: int, step: int) -> bool:
    try:
        return int(Path(f"{marker}.{rank}").read_text() or 0) >= step
    except (OSError, ValueError):
        return False


def _wait_for_step(
    proc: Proc | subprocess.Popen[str], marker: Path, ranks: int = 1, step: int = 1, timeout: float = 240
) -> None:
    deadline = time.monotonic() + timeout
    while not all(_reached(marker, r, step) for r in range(ranks)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"training did not start (rc {proc.returncode}): {err[-3000:]}")
        time.sleep(0.1)


def test_first_ctrl_c_saves_and_says_how_to_resume(kforge, tmp_path: Path) -> None:
    proc, run, marker = _start(tmp_path)
    _wait_for_step(proc, marker, step=2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err
    saved = sorted((run / "checkpoints").glob("step_*"))
    assert saved, err[-2000:]
    assert f"continue with: kforge resume {run} --allow-hooks=tests.helpers.slow_hooks" in err, err[-2000:]
    # Resuming with a max_steps the run is already past does nothing, and says so.
    metrics_before = (run / "metrics.jsonl").read_text()
    r = kforge("resume", str(run), "--allow-hooks=tests.helpers.slow_hooks", "--train.max_steps=1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already past train.max_steps=1" in r.stderr and "nothing to do" in r.stderr, r.stderr[-2000:]
    assert (run / "metrics.jsonl").read_text() == metrics_before
    assert sorted((run / "checkpoints").glob("step_*")) == saved


def test_second_ctrl_c_stops_at_once_without_saving(tmp_path: Path) -> None:
    proc, run, marker = _start(tmp_path)
    _wait_for_step(proc, marker)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # both land inside one (0.3 s) step
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert not list((run / "checkpoints").glob("step_*"))


def test_local_launcher_forwards_sigterm_and_exits_75(tmp_path: Path) -> None:
    proc, run, marker = _start(tmp_path, "--nproc-per-node", "2")
    _wait_for_step(proc, marker, ranks=2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert list((run / "checkpoints").glob("step_*")), err[-2000:]
    assert err.count("after saving a checkpoint") >= 1
