"""Shrink instead of waiting on a real SLURM: a 2-node job with slurm.min_nodes = 1 asks for --nodes=1-2,
starts on the one node the test cluster has, and trains re-planned (half the processes, twice the
accumulation, the same global batch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.slurm.cluster import LocalSlurm
from tests.slurm.test_slurm_jobs import job_logs, submit, write_config

pytestmark = pytest.mark.slurm


def test_a_two_node_job_with_min_nodes_one_starts_on_one_node_and_keeps_the_global_batch(
    slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job_id = submit(
        slurm_cluster, write_config(tmp_path / "tiny.toml", steps=4), run_dir, "--slurm.nodes=2", "--slurm.min_nodes=1"
    )
    assert "#SBATCH --nodes=1-2\n" in (run_dir / "job.sbatch").read_text()
    info = slurm_cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, job_logs(run_dir))
    assert info["NumNodes"] == "1" and info["NumTasks"] == "2"  # started on what it got, not waiting for 2
    rank0 = (run_dir / "logs" / "rank_0.log").read_text()
    assert "[WARNING] starting" in rank0 and "chosen by the shrink policy: slurm.min_nodes" in rank0, rank0
    (record,) = [json.loads(line) for line in (run_dir / "config_changes.jsonl").read_text().splitlines()]
    assert record["policy"] == "slurm.min_nodes" and record["layout"] == {
        "from": "4 processes (dp_shard=4), grad_accum_steps 1",
        "to": "2 processes (dp_shard=2), grad_accum_steps 2",
    }
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == 4 and last["tokens_seen"] == 4 * 16 * 32  # the global batch of 4 ranks x batch 4
