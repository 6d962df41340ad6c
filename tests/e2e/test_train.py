"""`kforge train` for real, in a subprocess."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_train_with_no_arguments_learns(kforge, tmp_path: Path) -> None:
    r = kforge("train", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("cpu-debug-")
    records = read_metrics(runs[0])
    steps = [m for m in records if "loss" in m]
    evals = [m for m in records if "eval_loss" in m]
    assert steps[0]["step"] == 1 and steps[-1]["step"] == 300
    for key in ("loss", "lr", "grad_norm", "tokens_seen", "tokens_per_sec", "step_time_s", "time"):
        assert key in steps[-1], key
    assert steps[-1]["tokens_seen"] == 300 * 16 * 128
    first, last = steps[0]["loss"], steps[-1]["loss"]
    assert last < 0.6 * first, (first, last)
    assert evals and evals[-1]["eval_loss"] < 0.6 * first
    assert (runs[0] / "config.toml").is_file() and (runs[0] / "logs" / "rank_0.log").is_file()


def test_nan_abort_exits_non_zero(kforge, tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "KFORGE_TEST_NAN_STEPS": "2"}  # fmt: skip
    r = kforge("train", "--run-dir", str(tmp_path / "run"), "--train.max_steps=5", "--eval.interval=0",
               '--train.hooks=["tests.helpers.nan_hooks:InjectNaN"]', "--resilience.nan_policy=abort",
               "--resilience.nan_max_consecutive=1", env=env)  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    assert "nan_policy = 'abort'" in r.stderr and "Traceback" not in r.stderr


def test_bad_hook_path_is_a_clear_error(kforge, tmp_path: Path) -> None:
    r = kforge("train", "--run-dir", str(tmp_path / "run"), '--train.hooks=["no_such_pkg.mod:Hook"]')
    assert r.returncode == 2 and "no_such_pkg" in r.stderr and "Traceback" not in r.stderr
