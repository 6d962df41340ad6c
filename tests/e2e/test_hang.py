"""The hang watchdog on 2 gloo ranks: one rank stalls inside a step, the job says which and comes back."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_kforge
from tests.helpers.metrics import step_losses
from tests.helpers.tiny import QUIET, model

pytestmark = pytest.mark.e2e

PG_TIMEOUT_S = 600
TINY = [
    *model(32, 2, 2, 1),
    *QUIET,
    "--train.batch_size=2",
    "--train.seq_len=32",
    "--train.max_steps=12",
    "--scheduler.warmup_steps=1",
    "--checkpoint.interval=4",
    "--resilience.hang_timeout_s=3",
    f"--distributed.timeout_s={PG_TIMEOUT_S}",
    '--train.hooks=["tests.helpers.hang_hooks:HangOnce"]',
]


def _train(run: Path, env: dict[str, str]) -> tuple[int, str, float]:
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **env,
    }
    t0 = time.monotonic()
    r = run_kforge("train", "--nproc-per-node", "2", "--run-dir", str(run), *TINY, env=env, timeout=900)
    return r.returncode, r.stderr, time.monotonic() - t0


def test_a_stalled_rank_is_named_and_the_same_command_resumes(tmp_path: Path) -> None:
    run, marker = tmp_path / "run", tmp_path / "stalled"
    env = {"KFORGE_TEST_HANG_STEP": "6", "KFORGE_TEST_HANG_RANK": "1", "KFORGE_TEST_HANG_MARKER": str(marker)}
    code, err, seconds = _train(run, env)
    assert code == 76, err[-3000:]
    assert marker.exists()  # rank 1 really stalled inside step 6
    assert seconds < PG_TIMEOUT_S, seconds
    hang = run / "logs" / "hang"
    reports = {r: json.loads((hang / f"rank_{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        text = (hang / f"rank_{r}.txt").read_text()
        assert "Thread MainThread" in text and "kforge-hang-watchdog" in text, text[:2000]
        assert reports[r]["step"] == 5 and reports[r]["phase"] == "forward/backward", reports[r]
        assert reports[r]["idle_s"] < PG_TIMEOUT_S / 10, reports[r]
    assert reports[1]["in_collective"] is False and "hang_hooks.py" in reports[1]["where"], reports[1]
    assert reports[0]["in_collective"] is True, reports[0]
    summary = (hang / "summary.txt").read_text()
    stopped = [line for line in summary.splitlines() if line.startswith("Stopped:")]
    assert len(stopped) == 1 and stopped[0].startswith("Stopped: rank 1 "), summary
    assert "hang_hooks.py" in stopped[0], summary
    assert "Waiting in a collective: rank(s) 0" in summary, summary
    assert "a rank hung (exit code 76)" in err, err[-3000:]

    code, err, _ = _train(run, env)  # the same command: resumes from step 4 and finishes
    assert code == 0, err[-3000:]
    assert "resumed from" in err and "an earlier attempt of this run hung" in err, err[-3000:]
    assert (run / "logs" / "hang.1" / "summary.txt").is_file()

    ref = tmp_path / "ref"
    code, err, _ = _train(ref, {})  # uninterrupted
    assert code == 0, err[-3000:]
    resumed, reference = step_losses(run), step_losses(ref)
    assert sorted(reference) == list(range(1, 13))
    assert resumed == reference
