"""A checkpoint written by an older kforge (tests/data/old_checkpoint) resumes bit for bit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.launch import with_repo_path

pytestmark = pytest.mark.e2e

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "old_checkpoint"


def test_the_old_checkpoint_resumes_to_the_recorded_losses(kforge, tmp_path: Path) -> None:
    run = tmp_path / "old_checkpoint"
    shutil.copytree(FIXTURE, run)
    r = kforge("resume", str(run), "--train.max_steps=6", env=with_repo_path(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_3'} (step 3)" in r.stderr
    want = json.loads((FIXTURE / "expected_losses.json").read_text())["steps"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    got = {
        str(rec["step"]): {k: rec[k] for k in ("loss", "grad_norm", "scaler/scale")}
        for rec in records
        if "loss" in rec and rec["step"] > 3
    }
    assert got == want  # floats compared exactly: the loss scale and spike history came back too
    saved = json.loads((run / "checkpoints" / "step_6" / "train_state.json").read_text())
    assert saved["step"] == 6 and saved["parts"]["update"]["loss_scale"]["scale"] == 2.0**16
    assert len(saved["parts"]["loss_spike"]["history"]) == 4 and "spike_guard" not in saved  # the new names
