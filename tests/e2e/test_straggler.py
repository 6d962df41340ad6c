"""The straggler report on 2 gloo ranks: a slowed rank is named, equal ranks raise no warning."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kforge_cli.engine.observe import read_metrics
from tests.conftest import REPO, run_kforge
from tests.helpers.tiny import ONE_THREAD, model

pytestmark = pytest.mark.e2e

TINY = [
    *model(32, 2, 2, 1),
    *ONE_THREAD,
    "--train.batch_size=2",
    "--train.seq_len=32",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
]


def _train(run: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[list[dict], str]:
    full_env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    r = run_kforge("train", "--nproc-per-node", "2", "--run-dir", str(run), *TINY, *extra, env=full_env)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [rec for rec in read_metrics(run / "metrics.jsonl") if "straggler/max_over_median" in rec]
    return records, r.stderr


def test_a_rank_slowed_in_its_own_work_is_named_with_its_host(tmp_path: Path) -> None:
    records, err = _train(
        tmp_path / "run",
        "--train.max_steps=40",
        "--metrics.log_interval=5",
        '--train.hooks=["tests.helpers.hang_hooks:SlowRank"]',
        env={"KFORGE_TEST_SLOW_RANK": "1", "KFORGE_TEST_SLOW_S": "0.03"},
    )
    assert [rec["step"] for rec in records] == [1, *range(5, 41, 5)]
    later = records[1:]
    assert all(rec["straggler/slowest_rank"] == 1 for rec in later), later
    assert all(rec["straggler/max_over_median"] > 3 for rec in later), later
    assert all(rec["straggler/slowest_ms"] >= 30 for rec in later), later
    host = later[0]["straggler/slowest_host"]
    warnings = [line for line in err.splitlines() if "straggler: rank" in line]
    assert warnings and all(f"straggler: rank 1 (host {host})" in line for line in warnings), err[-3000:]
    assert "for 3 logging intervals in a row" in warnings[0] and "for 6 logging intervals" in warnings[1], warnings


def test_equal_ranks_raise_no_warning_over_200_steps(tmp_path: Path) -> None:
    records, err = _train(tmp_path / "run", "--train.max_steps=200")
    assert len(records) == 21  # step 1 and every 10th step: every logged step carries the report
    assert {rec["straggler/slowest_rank"] for rec in records} <= {0, 1}
    assert "straggler:" not in err, err[-3000:]


def test_with_exclude_stragglers_a_lasting_straggler_on_a_slurm_node_is_recorded_and_the_run_stops_to_requeue(
    tmp_path: Path,
) -> None:
    """Rank 1 slowed, SLURMD_NODENAME=n7: above exclude_straggler_ratio in the windows ending at steps 2 and 4,
    so the run records n7 and stops at the next agreed step (5) with a checkpoint, exit 75; the job
    script's decision then names n7."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "KFORGE_TEST_SLOW_RANK": "1",
        "KFORGE_TEST_SLOW_S": "0.03",
        "SLURMD_NODENAME": "n7",
    }
    r = run_kforge(
        "train", "--nproc-per-node", "2", "--run-dir", str(run), *TINY, "--train.max_steps=40",
        "--metrics.log_interval=2", '--train.hooks=["tests.helpers.hang_hooks:SlowRank"]',
        "--resilience.exclude_stragglers=true", "--resilience.exclude_straggler_ratio=2",
        "--resilience.exclude_straggler_windows=2", "--resilience.stop_check_interval=5", env=env,
    )  # fmt: skip
    assert r.returncode == 75, r.stderr[-3000:]
    assert "straggler: rank 1 on SLURM node n7 stayed above resilience.exclude_straggler_ratio" in r.stderr
    assert "stopped by the straggler exclusion (node n7) at step 5 after saving a checkpoint" in r.stderr, r.stderr
    (record,) = [json.loads(line) for line in (run / "logs" / "stragglers.jsonl").read_text().splitlines()]
    assert {k: record[k] for k in ("step", "rank", "node", "windows", "threshold")} == {
        "step": 4, "rank": 1, "node": "n7", "windows": 2, "threshold": 2.0,
    }  # fmt: skip
    assert record["ratio"] > 2
    logged = [rec for rec in read_metrics(run / "metrics.jsonl") if "straggler/slowest_node" in rec]
    assert [rec["step"] for rec in logged] == [1, 2, 4] and logged[-1]["straggler/slowest_node"] == "n7"
    decide = [sys.executable, "-m", "kforge_cli.slurm.exclude", str(run), "--from", "straggler", "--max", "2"]
    out = subprocess.run(decide, capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert out.returncode == 0 and out.stdout == "n7\n", out.stderr
