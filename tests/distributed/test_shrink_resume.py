"""Shrink instead of waiting (slurm.min_nodes), for real: 2 data-parallel ranks stop, the job comes back
with 1 (re-planned: grad_accum 1 -> 2, the global batch kept), then with 2 again (grown back).

Each rank is a real `kforge train` process (RANK/WORLD_SIZE as torchrun sets them), relaunched with the
run's own arguments as a requeued job's tasks are; the world size is all that changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kforge_cli.engine.checkpoint import read_latest
from tests.distributed.test_checkpoint_resume import launch, ok
from tests.e2e.test_resume import ARGS, HOOK, NO_HOOK, losses

pytestmark = pytest.mark.distributed

# 2 nodes of 1 process, may start on 1; batch 8 per rank: a global batch of 16 sequences
POLICY = ["--slurm.nodes=2", "--slurm.min_nodes=1", "--train.max_steps=12", "--resilience.stop_check_interval=1"]


def layout_records(run: Path) -> list[dict]:
    lines = (run / "config_changes.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "layout" in r]


def test_shrink_to_one_data_parallel_group_keeps_the_global_batch_and_grows_back(tmp_path: Path) -> None:
    run, ref = tmp_path / "run", tmp_path / "ref"
    stopped = launch(2, run, [*ARGS, *POLICY, HOOK], {"KFORGE_TEST_SIGTERM_STEP": "4"})
    ok(stopped, 75)
    step_4 = run / "checkpoints" / "step_4"
    assert read_latest(run / "checkpoints") == step_4
    # the reference: uninterrupted at the new layout (1 process, accumulation 2) from the same checkpoint
    ok(
        launch(
            1, ref, [*ARGS, "--train.max_steps=12", "--train.grad_accum_steps=2", f"--checkpoint.load_path={step_4}"]
        )
    )

    # the job comes back with 1 of its 2 processes: re-planned, resumed, stopped again after step 8
    shrunk = launch(1, run, [*ARGS, *POLICY, HOOK], {"KFORGE_TEST_SIGTERM_STEP": "8"})
    ok(shrunk, 75)
    log = shrunk[0][1]
    assert f"resumed from {step_4} (step 4)" in log
    warning = next(line for line in log.splitlines() if "[WARNING] continuing" in line)
    assert "2 processes (dp_shard=2), grad_accum_steps 1 -> 1 process (no parallelism), grad_accum_steps 2" in warning
    assert "chosen by the shrink policy: slurm.min_nodes: the job got 1 of 2 processes" in warning
    assert "global batch 16 sequences kept" in warning
    (record,) = layout_records(run)
    assert record["policy"] == "slurm.min_nodes" and record["changes"] == {}
    assert record["layout"] == {
        "from": "2 processes (dp_shard=2), grad_accum_steps 1",
        "to": "1 process (no parallelism), grad_accum_steps 2",
    }
    assert "train.grad_accum_steps 1 -> 2" in record["reason"]
    launched = json.loads((run / "launch.json").read_text())
    assert launched["world_size"] == 1 and launched["grad_accum_steps"] == 2
    assert "grad_accum_steps = 1" in (run / "config.toml").read_text()  # the run's own settings stay

    # the nodes came back: the next start grows to the configured layout
    grown = launch(2, run, [*ARGS, *POLICY, NO_HOOK])
    ok(grown)
    assert f"resumed from {run / 'checkpoints' / 'step_8'} (step 8)" in grown[0][1]
    back = layout_records(run)[1]
    assert back["layout"]["to"] == "2 processes (dp_shard=2), grad_accum_steps 1"
    assert "the job has its configured 2 nodes" in back["reason"]

    got, want = losses(run), losses(ref)
    assert sorted(got) == list(range(1, 13)) and sorted(want) == list(range(5, 13))
    for step in range(5, 13):  # 5-8 at 1 process, 9-12 at 2 again: only the reductions' order differs
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), (step, got[step], want[step])
