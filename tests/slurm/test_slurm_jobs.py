"""Generated sbatch scripts on a real one-node SLURM: two CPU tasks (gloo) train, survive a requeue
and a time limit by saving, exiting 75 and requeueing themselves, and end on the same loss curve.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, run_kforge
from tests.helpers.metrics import step_losses as losses
from tests.slurm.cluster import LocalSlurm

pytestmark = pytest.mark.slurm

STEPS = 200  # 40 ms a step on 2 idle CPUs: a window to interrupt mid-run even when a loaded machine answers late
TINY = """
[model]
dim = 32
n_layers = 2
n_heads = 2
n_kv_heads = 1
max_seq_len = 64

[train]
batch_size = 4
seq_len = 32
max_steps = {steps}
num_threads = 1

[scheduler]
warmup_steps = 5

[eval]
interval = 0

[checkpoint]
interval = 0
keep_last_n = 0

[metrics]
log_interval = 1
progress_bar = "off"

[slurm]
job_name = "kforge-test"
gpus_per_node = 2
cpus_per_task = 1
mem = "0"
time_limit = "{time_limit}"
signal_before_s = {signal_before_s}
"""


def write_config(path: Path, steps: int = STEPS, time_limit: str = "00:10:00", signal_before_s: int = 300) -> Path:
    path.write_text(TINY.format(steps=steps, time_limit=time_limit, signal_before_s=signal_before_s))
    return path


def submit(cluster: LocalSlurm, config: Path, run_dir: Path, *extra: str) -> str:
    """`kforge train --sbatch --submit` on the test cluster; the job id it printed."""
    r = run_kforge(
        "train",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        "--sbatch",
        "--submit",
        *extra,
        env=cluster.env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert job_id.isdigit(), r.stdout
    assert f"submitted {run_dir / 'job.sbatch'} as job {job_id}" in r.stderr
    return job_id


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def wait_for(what: str, ready: Any, timeout: float, cluster: LocalSlurm, run_dir: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} within {timeout} s\n{job_logs(run_dir)}\n{cluster.logs()}")


def job_logs(run_dir: Path) -> str:
    return "\n".join(
        f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted((run_dir / "logs").glob("*"))
    )


def batch_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


def signal_checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints saved because of a signal (their metadata.json says why)."""
    steps = []
    for meta in (run_dir / "checkpoints").glob("step_*/metadata.json"):
        record = json.loads(meta.read_text())
        if record["reason"] == "signal":
            steps.append(record["step"])
    return sorted(steps)


@pytest.fixture(scope="module")
def reference(slurm_cluster: LocalSlurm, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """An uninterrupted 2-task job (the generated script, submitted by kforge); its per-step losses."""
    tmp = tmp_path_factory.mktemp("ref")
    run_dir = tmp / "run"
    job_id = submit(slurm_cluster, write_config(tmp / "tiny.toml"), run_dir)
    info = slurm_cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, job_logs(run_dir))
    assert info["Restarts"] == "0" and info["NumTasks"] == "2" and info["Requeue"] == "1"
    out = batch_log(run_dir, job_id)
    assert f"kforge: job {job_id} restart 0" in out and "kforge: training complete" in out, out
    rank0 = (run_dir / "logs" / "rank_0.log").read_text()
    assert "mesh: 2 processes, pp=1 dp_replicate=1 dp_shard=2" in rank0 and (run_dir / "logs" / "rank_1.log").is_file()
    assert {f.name for f in (run_dir / "logs").glob("srun_rank*.out")} == {"srun_rank0.out", "srun_rank1.out"}
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]  # the last step record (checkpoint records follow it)
    assert last["tokens_seen"] == STEPS * 4 * 32 * 2  # batch 4 x seq 32 on each of the 2 ranks
    assert curve[STEPS] < curve[1] - 1.0  # it learned
    final = json.loads((run_dir / "checkpoints" / f"step_{STEPS}" / "metadata.json").read_text())
    assert final["reason"] == "final" and final["world_size"] == 2
    return curve


def test_two_cpu_tasks_train_to_completion(reference: dict[int, float]) -> None:
    assert len(reference) == STEPS  # the checks are in the fixture, shared with the preemption test


def test_requeue_mid_run_saves_exits_75_requeues_and_ends_on_the_same_losses(
    slurm_cluster: LocalSlurm, reference: dict[int, float], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, write_config(tmp_path / "tiny.toml"), run_dir)
    wait_for("step 2", lambda: logged_steps(run_dir) >= 2, 120, slurm_cluster, run_dir)
    slurm_cluster.run("scontrol", "requeue", job_id)  # what a preemption with PreemptMode=REQUEUE does
    info = slurm_cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, job_logs(run_dir))
    assert info["Restarts"] == "1"
    stops = signal_checkpoints(run_dir)
    assert len(stops) == 1 and 2 <= stops[0] < STEPS, stops  # one emergency checkpoint, mid-run
    out = batch_log(run_dir, job_id)
    assert f"kforge: job {job_id} restart 0" in out and f"kforge: job {job_id} restart 1" in out, out
    assert re.search(r"srun: error: .*: Exited with exit code 75", out), out  # the stopped run's exit code
    srun0 = (run_dir / "logs" / "srun_rank0.out").read_text()
    # SLURM's SIGTERM reaches every rank; a rank that sees a peer's flag first names it "peer signal"
    assert re.search(rf"stopped by (SIGTERM|peer signal) at step {stops[0]} after saving a checkpoint", srun0), srun0
    assert f"(step {stops[0]})" in (run_dir / "logs" / "rank_0.log").read_text()  # resumed from it
    assert losses(run_dir) == reference  # bit for bit: same data order, RNG and reduction order


def test_time_limit_signal_saves_and_requeues_before_slurm_kills_the_job(
    slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    """--time=1 with USR1 5 s before it: SLURM sends it 25-55 s in (its time checks run every 30 s, and
    it signals up to one period early), after the ranks installed their handlers."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "tiny.toml", steps=1_000_000, time_limit="1", signal_before_s=5)
    job_id = submit(slurm_cluster, config, run_dir)
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --time=1\n" in script and "#SBATCH --signal=USR1@5\n" in script
    out = run_dir / "logs" / f"slurm-{job_id}.out"
    resumed = re.compile(r"resumed from .*\(step (\d+)\)")

    def second_run_resumed() -> bool:
        return (run_dir / "logs" / "rank_0.log").is_file() and bool(
            resumed.search((run_dir / "logs" / "rank_0.log").read_text())
        )

    wait_for(
        "the job to requeue itself",
        lambda: out.is_file() and "requeueing job" in out.read_text(),
        150,
        slurm_cluster,
        run_dir,
    )
    # The second run would get its own early signal 25-55 s in; give it room to start and resume first.
    slurm_cluster.run("scontrol", "update", f"jobid={job_id}", "TimeLimit=10")
    wait_for("the requeued job to resume", second_run_resumed, 150, slurm_cluster, run_dir)
    first = slurm_cluster.job(job_id)
    assert first["Restarts"] == "1" and first["JobState"] == "RUNNING", first
    text = out.read_text()
    assert "requeueing job" in text and "restart 1" in text, text
    assert re.search(r"srun: error: .*: Exited with exit code 75", text), text
    stops = signal_checkpoints(run_dir)
    srun0 = (run_dir / "logs" / "srun_rank0.out").read_text()
    assert len(stops) == 1, stops
    assert re.search(rf"stopped by (SIGUSR1|peer signal) at step {stops[0]} after saving a checkpoint", srun0), srun0
    srun1 = (run_dir / "logs" / "srun_rank1.out").read_text()
    assert "received SIGUSR1" in srun0 + srun1  # SLURM's --signal reached the training ranks through srun
    match = resumed.search((run_dir / "logs" / "rank_0.log").read_text())
    assert match is not None and int(match.group(1)) == stops[0]
    # scancel is not a preemption: the job saves once more, exits 75 and is NOT requeued.
    slurm_cluster.run("scancel", job_id)
    slurm_cluster.wait_gone(job_id, 120)  # the batch shell has finished: a (wrong) requeue would show now
    info = slurm_cluster.job(job_id)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "1", info
    assert "job is COMPLETING (cancelled, ending or requeued): not requeueing" in out.read_text()
    steps = sorted(losses(run_dir))
    assert steps == list(range(1, steps[-1] + 1))  # no step lost or skipped across the requeue


def test_a_script_sbatch_refuses_is_a_clear_error_with_sbatchs_message_and_the_script(
    slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    r = run_kforge(
        "train",
        "--config",
        str(write_config(tmp_path / "tiny.toml")),
        "--run-dir",
        str(run_dir),
        "--sbatch",
        "--submit",
        "--slurm.partition=nosuch",
        env=slurm_cluster.env,
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert f"error: sbatch refused {run_dir / 'job.sbatch'} (exit code 1):" in r.stderr
    assert "invalid partition specified: nosuch" in r.stderr  # sbatch's own words
    assert "#SBATCH --partition=nosuch" in (run_dir / "job.sbatch").read_text()
    assert slurm_cluster.run("squeue", "-h").stdout.strip() == ""


def test_a_hung_rank_exits_76_the_script_requeues_and_the_job_ends_on_the_same_losses(
    slurm_cluster: LocalSlurm, reference: dict[int, float], tmp_path: Path
) -> None:
    """Rank 1 stalls inside step 30 (once): the watchdog stops both ranks with 76, the script requeues
    the job, which resumes from step 20 and ends on the uninterrupted job's losses."""
    run_dir = tmp_path / "run"
    text = write_config(tmp_path / "tiny.toml").read_text()
    text = text.replace("num_threads = 1\n", 'num_threads = 1\nhooks = ["tests.helpers.hang_hooks:HangOnce"]\n')
    text = text.replace("[checkpoint]\ninterval = 0\n", "[checkpoint]\ninterval = 10\n")
    marker = tmp_path / "stalled"
    text += (
        '\n[resilience]\nhang_timeout_s = 5\n\n[slurm.env]\nKFORGE_TEST_HANG_STEP = "30"\n'
        f'KFORGE_TEST_HANG_RANK = "1"\nKFORGE_TEST_HANG_MARKER = "{marker}"\n'
        f'PYTHONPATH = "{REPO / "src"}:{REPO}"\n'  # this checkout's kforge_cli and the hook's package (tests)
    )
    config = tmp_path / "hang.toml"
    config.write_text(text)
    job_id = submit(slurm_cluster, config, run_dir, "--allow-hooks=tests.helpers.hang_hooks")  # --config names it
    info = slurm_cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, job_logs(run_dir))
    assert info["Restarts"] == "1" and marker.exists()
    out = batch_log(run_dir, job_id)
    assert f"kforge: a rank hung (see {run_dir}/logs/hang/summary.txt); requeueing job {job_id}" in out, out
    assert re.search(r"srun: error: .*: Exited with exit code 76", out), out
    summary = (run_dir / "logs" / "hang.1" / "summary.txt").read_text()  # moved aside by the second start
    assert "\nStopped: rank 1 " in summary, summary
    # one node in the partition, and the job needs it: named, never excluded
    assert f"kforge: not excluding {slurm_cluster.node} (hang: rank 1" in out, out
    assert "the cap allows no excluded node" in out and info["ExcNodeList"] == "(null)", out
    assert "(step 20)" in (run_dir / "logs" / "rank_0.log").read_text()  # resumed from the last checkpoint
    assert losses(run_dir) == reference


def test_a_hang_on_node_n2_requeues_the_job_without_n2_and_it_ends_on_the_same_losses(
    slurm_three_nodes: LocalSlurm, reference: dict[int, float], tmp_path: Path
) -> None:
    """Three SLURM nodes, a 2-node job (one task each): rank 1 on n2 stalls in step 30, the watchdog names
    n2, the script requeues the job with ExcNodeList=n2 (the cap: the partition spares one node), the job
    runs again on n1 and n3 and ends on the losses of the uninterrupted 2-task job."""
    cluster = slurm_three_nodes
    run_dir = tmp_path / "run"
    text = write_config(tmp_path / "tiny.toml").read_text()
    text = text.replace("gpus_per_node = 2\n", "nodes = 2\ngpus_per_node = 1\n")
    text = text.replace("num_threads = 1\n", 'num_threads = 1\nhooks = ["tests.helpers.hang_hooks:HangOnce"]\n')
    text = text.replace("[checkpoint]\ninterval = 0\n", "[checkpoint]\ninterval = 10\n")
    marker = tmp_path / "stalled"
    pythonpath = f"{REPO / 'src'}:{REPO}"  # this checkout's kforge_cli (the exclusion decision) and the hook
    text += (
        '\n[resilience]\nhang_timeout_s = 5\n\n[slurm.env]\nKFORGE_TEST_HANG_STEP = "30"\n'
        f'KFORGE_TEST_HANG_RANK = "1"\nKFORGE_TEST_HANG_MARKER = "{marker}"\nPYTHONPATH = "{pythonpath}"\n'
    )
    config = tmp_path / "hang.toml"
    config.write_text(text)
    job_id = submit(cluster, config, run_dir, "--allow-hooks=tests.helpers.hang_hooks")
    info = cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, job_logs(run_dir), cluster.logs())
    assert info["Restarts"] == "1" and marker.exists()
    assert info["ExcNodeList"] == "n2" and info["NodeList"] == "n[1,3]", info  # from `scontrol show job`
    out = batch_log(run_dir, job_id)
    assert f"kforge: job {job_id} restart 0 on n[1-2]:" in out and f"kforge: job {job_id} restart 1 on n[1,3]:" in out
    assert re.search(r"kforge: excluding n2 \(hang: rank 1 \(host \S+\) stopped at step 29\)", out), out
    assert f"kforge: job {job_id} excludes node(s): n2\n" in out and "ExcNodeList=n2 failed" not in out, out
    summary = (run_dir / "logs" / "hang.1" / "summary.txt").read_text()
    assert re.search(r"\nStopped: rank 1 \(host \S+, SLURM node n2\)", summary), summary
    assert json.loads((run_dir / "excluded_nodes.json").read_text())["nodes"] == ["n2"]
    assert "(step 20)" in (run_dir / "logs" / "rank_0.log").read_text()  # resumed from the last checkpoint
    assert losses(run_dir) == reference


def test_every_checkpoint_is_evaluated_by_a_slurm_job_of_its_own(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """eval.after_checkpoint inside a SLURM job: each committed checkpoint gets an sbatch job of its own
    (one CPU beside the training's), which writes eval/step_N.json and its status; training does not
    wait for them."""
    config = tmp_path / "tiny.toml"
    text = TINY.format(steps=4, time_limit="00:10:00", signal_before_s=300).replace(
        "gpus_per_node = 2", "gpus_per_node = 1"
    )
    text = text.replace("[checkpoint]\ninterval = 0", "[checkpoint]\ninterval = 2")
    config.write_text(text.replace("[eval]\ninterval = 0", "[eval]\ninterval = 0\nsteps = 2\nafter_checkpoint = true"))
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, config, run_dir)
    info = slurm_cluster.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 300)
    assert info["JobState"] == "COMPLETED", (info, job_logs(run_dir))
    from kforge_cli.rundir.eval_records import read_status

    def ended() -> bool:
        return all((read_status(run_dir, s) or {}).get("state") in ("done", "failed") for s in (2, 4))

    wait_for("both evaluations ended", ended, 180, slurm_cluster, run_dir)
    for step in (2, 4):
        status = read_status(run_dir, step) or {}
        assert status["state"] == "done" and status["launcher"] == "sbatch", (status, job_logs(run_dir))
        eval_job = str(status["slurm_job"])
        assert eval_job.isdigit() and eval_job != job_id
        assert slurm_cluster.job(eval_job)["JobName"] == f"kforge-eval-step_{step}"
        result = json.loads((run_dir / "eval" / f"step_{step}.json").read_text())
        assert result["step"] == step and result["tasks"]["heldout"]["batches"] == 2
        assert (run_dir / "logs" / f"eval_step_{step}-{eval_job}.log").is_file()
