"""The bad node left behind: which SLURM node a requeued job excludes (kforge_cli.slurm.exclude), from the
hang watchdog's stopped.json or a straggler record, with the cap; what the watchdog and the straggler
report record for it; the generated script's `#SBATCH --exclude` for a new job of the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kforge_cli.engine.resilience.hang_report import stopped_record, summarise
from kforge_cli.engine.resilience.straggler import StragglerMonitor
from kforge_cli.errors import ConfigError
from kforge_cli.settings import load_settings
from kforge_cli.slurm import write_job
from kforge_cli.slurm.exclude import EXCLUDED_FILE, allowed_count, decide, main
from tests.helpers.tiny_run import tiny_settings


def hang(run_dir: Path, step: int, *ranks: tuple[int, str | None]) -> None:
    """A stopped.json as the watchdog writes it: (rank, SLURM node) of each stopped rank."""
    d = run_dir / "logs" / "hang"
    d.mkdir(parents=True, exist_ok=True)
    record = {
        "step": step,
        "time": f"t{step}",
        "world_size": 4,
        "ranks": [{"rank": r, "host": "vm", "node": n, "why": "x"} for r, n in ranks],
    }
    (d / "stopped.json").write_text(json.dumps(record))


def saved(run_dir: Path) -> dict[str, list[object]]:
    return json.loads((run_dir / EXCLUDED_FILE).read_text())


def test_a_hang_on_one_node_excludes_it_once_and_the_list_accumulates(tmp_path: Path) -> None:
    hang(tmp_path, 30, (1, "n2"))
    nodes, notes = decide(tmp_path, "hang", cap=2)
    assert nodes == ["n2"] and notes == ["excluding n2 (hang: rank 1 (host vm) stopped at step 30)"]
    assert saved(tmp_path)["nodes"] == ["n2"]
    assert decide(tmp_path, "hang", cap=2) == (["n2"], ["n2: this hang was already handled"])  # the same event
    hang(tmp_path, 50, (3, "n4"))
    assert decide(tmp_path, "hang", cap=2)[0] == ["n2", "n4"]
    assert [h["node"] for h in saved(tmp_path)["history"]] == ["n2", "n4"]


def test_past_the_cap_the_oldest_exclusion_goes_back_in(tmp_path: Path) -> None:
    for step, node in ((10, "n1"), (20, "n2"), (30, "n3")):
        hang(tmp_path, step, (0, node))
        nodes, notes = decide(tmp_path, "hang", cap=2)
    assert nodes == ["n2", "n3"]
    assert "letting n1 back in: at most 2 (slurm.max_excluded_nodes = 2) nodes are excluded" in notes
    assert saved(tmp_path)["history"][-1] == {**saved(tmp_path)["history"][-1], "action": "release", "node": "n1"}


def test_the_partition_keeps_room_for_the_job_and_a_cap_of_zero_excludes_nothing(tmp_path: Path) -> None:
    assert allowed_count(5, need_nodes=2, partition_nodes=3) == 1  # 3 nodes, a 2-node job: one may go
    assert allowed_count(5, need_nodes=4, partition_nodes=4) == 0
    assert allowed_count(2, need_nodes=2, partition_nodes=None) == 2  # partition unknown: the cap alone
    hang(tmp_path, 10, (0, "n1"))
    assert decide(tmp_path, "hang", cap=3, need_nodes=2, partition_nodes=3)[0] == ["n1"]
    hang(tmp_path, 20, (1, "n2"))
    nodes, notes = decide(tmp_path, "hang", cap=3, need_nodes=2, partition_nodes=3)
    assert nodes == ["n2"]
    assert notes[-1] == (
        "letting n1 back in: at most 1 (slurm.max_excluded_nodes = 3; the partition has 3 nodes, the job needs 2) "
        "nodes are excluded"
    )
    other = tmp_path / "off"
    hang(other, 10, (0, "n1"))
    nodes, notes = decide(other, "hang", cap=0)
    assert nodes == [] and "the cap allows no excluded node" in notes[0] and not (other / EXCLUDED_FILE).exists()


@pytest.mark.parametrize(
    ("ranks", "why"),
    [
        (((1, "n2"), (5, "n3")), "the stopped rank(s) ran on n2, n3: no single SLURM node"),
        (
            ((2, None),),
            "the stopped rank(s) ran on an unknown node: no single SLURM node",
        ),  # no report, or outside SLURM
        (
            ((1, "n2"), (2, "n2;rm -rf")),
            "ran on an unknown node, n2: no single SLURM node",
        ),  # not a node name: never reaches scontrol
        ((), "the hang summary names no stopped rank"),
    ],
)
def test_no_single_node_to_blame_excludes_nothing(
    tmp_path: Path, ranks: tuple[tuple[int, str | None]], why: str
) -> None:
    hang(tmp_path, 30, *ranks)
    nodes, notes = decide(tmp_path, "hang", cap=2)
    assert nodes == [] and why in notes[0] and not (tmp_path / EXCLUDED_FILE).exists()


def test_a_straggler_record_names_its_node_and_a_stop_without_one_keeps_the_list(tmp_path: Path) -> None:
    assert decide(tmp_path, "straggler", cap=2) == ([], [])  # a time-limit stop: no record, nothing to say
    logs = tmp_path / "logs"
    logs.mkdir()
    record = {"time": "t", "step": 40, "rank": 1, "host": "vm", "node": "n2", "ratio": 3.1, "windows": 4}
    (logs / "stragglers.jsonl").write_text(json.dumps(record) + "\n")
    nodes, notes = decide(tmp_path, "straggler", cap=2)
    assert nodes == ["n2"]
    assert notes == ["excluding n2 (straggler: rank 1 (host vm) 3.1x the median for 4 logging intervals up to step 40)"]
    assert decide(tmp_path, "straggler", cap=2)[0] == ["n2"]  # a later stop (time limit) keeps the exclusion


def test_links_in_the_run_directory_are_never_read_or_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"nodes": ["n9"], "history": []}))
    run = tmp_path / "run"
    hang(run, 30, (1, "n2"))
    (run / EXCLUDED_FILE).symlink_to(outside)
    assert decide(run, "hang", cap=2)[0] == ["n2"]  # the link's n9 was not read
    assert not (run / EXCLUDED_FILE).is_symlink() and json.loads(outside.read_text())["nodes"] == ["n9"]
    (run / "logs" / "hang" / "stopped.json").unlink()
    (run / "logs" / "hang" / "stopped.json").symlink_to(outside)
    assert decide(run, "hang", cap=2) == (["n2"], ["no node to exclude: no readable logs/hang/stopped.json"])


def test_the_command_prints_the_list_for_scontrol_and_says_why_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hang(tmp_path, 30, (1, "n2"))
    assert main([str(tmp_path), "--from", "hang", "--max", "2", "--need-nodes", "2", "--partition-nodes", ""]) == 0
    out = capsys.readouterr()
    assert out.out == "n2\n" and "kforge: excluding n2 (hang: rank 1" in out.err
    r = subprocess.run(  # as the job script runs it: a fresh interpreter, torch-free
        [sys.executable, "-X", "importtime", "-m", "kforge_cli.slurm.exclude", str(tmp_path), "--max", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == "n2\n" and "Warning" not in r.stderr, r.stderr
    assert "torch" not in {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()}


def _reports(directory: Path) -> None:
    directory.mkdir(parents=True)
    for r, node in enumerate(["n1", "n2"]):
        report = {
            "rank": r,
            "host": "vm",
            "node": node,
            "step": 29,
            "phase": "forward/backward",
            "idle_s": 6.0,
            "where": "hook.py:1 in stall",
            "in_collective": r == 0,
            "last_collectives": {"pg 0": {"seq": 90 - r, "op": "all_reduce", "state": "started"}},
        }
        (directory / f"rank_{r}.json").write_text(json.dumps(report))


def test_the_hang_summary_and_stopped_json_name_the_slurm_node(tmp_path: Path) -> None:
    _reports(tmp_path / "hang")
    record = stopped_record(tmp_path / "hang", 2)
    assert record["step"] == 29 and record["world_size"] == 2
    assert record["ranks"] == [{"rank": 1, "host": "vm", "node": "n2", "why": record["ranks"][0]["why"]}]  # type: ignore[index]
    assert "Stopped: rank 1 (host vm, SLURM node n2): not in a collective" in summarise(tmp_path / "hang", 2)


def test_a_straggler_above_the_exclusion_ratio_for_k_windows_on_a_slurm_node_becomes_an_exclusion() -> None:
    import torch

    m = StragglerMonitor(
        rank=0,
        world_size=2,
        device=torch.device("cpu"),
        ratio=1.5,
        windows=3,
        local_params=10,
        exclude_ratio=2.0,
        exclude_windows=3,
    )
    m.hosts, m.nodes = ["vm", "vm"], ["n1", "n2"]
    for step, ratio in ((1, 2.5), (2, 2.5), (3, 1.8), (4, 2.5), (5, 2.5)):  # 1.8: above 1.5, below 2.0
        m._track_exclusion(step, ratio, 1)
    assert m.exclusion is None  # two windows in a row since the dip
    m._track_exclusion(6, 3.0, 1)
    assert m.exclusion == {
        "step": 6, "rank": 1, "host": "vm", "node": "n2", "ratio": 3.0, "windows": 3, "threshold": 2.0,
    }  # fmt: skip
    outside = StragglerMonitor(
        rank=0, world_size=2, device=torch.device("cpu"), ratio=1.5, windows=3, local_params=10, exclude_ratio=2.0,
        exclude_windows=1,
    )  # fmt: skip
    outside.hosts, outside.nodes = ["a", "b"], [None, None]
    outside._track_exclusion(1, 5.0, 1)
    assert outside.exclusion is None  # no SLURM node: nothing to exclude, training goes on


def test_exclude_stragglers_needs_the_straggler_report() -> None:
    with pytest.raises(ConfigError, match="resilience.exclude_stragglers"):
        tiny_settings("--resilience.exclude_stragglers=true", "--resilience.straggler_ratio=0")
    with pytest.raises(ConfigError, match="resilience.exclude_straggler_ratio"):
        tiny_settings("--resilience.exclude_straggler_ratio=1")


def test_a_new_job_of_the_run_excludes_what_earlier_jobs_left_behind(tmp_path: Path) -> None:
    run = tmp_path / "run"
    settings = load_settings(overrides=[f"--train.run_dir={run}", "--slurm.max_excluded_nodes=1"]).settings
    text = write_job(settings, python="/opt/env/bin/python", workdir=tmp_path).script.read_text()
    assert "--exclude" not in text
    assert f"/opt/env/bin/python -m kforge_cli.slurm.exclude {run} --max 1 --need-nodes 1" in text
    (run / EXCLUDED_FILE).write_text(json.dumps({"nodes": ["n1", "n3"], "history": []}))
    text = write_job(settings, python="/opt/env/bin/python", workdir=tmp_path).script.read_text()
    assert "#SBATCH --exclude=n3\n" in text  # the newest, within the cap


def test_the_script_after_a_straggler_stop_requeues_then_sets_the_exclusion(tmp_path: Path) -> None:
    """srun exits 75 after a straggler stop: `scontrol requeue`, then `scontrol update ... ExcNodeList=n7`
    (the order SLURM needs; on the real cluster: tests/slurm); a stop without a record sets nothing."""
    run = tmp_path / "run"
    settings = load_settings(overrides=[f"--train.run_dir={run}", "--slurm.nodes=2"]).settings
    script = write_job(settings, python=sys.executable, workdir=tmp_path).script
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for name, body in {
        "srun": "exit 75",
        "scontrol": (
            f'echo "$*" >> {calls}\n'
            'case "$1 $2" in "show job") echo "JobState=RUNNING";; "show partition") echo "TotalNodes=4";; esac'
        ),
    }.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_PARTITION": "gpu",
    }
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "kforge: job 42 excludes" not in r.stdout, r.stdout + r.stderr
    assert "update" not in calls.read_text()  # a time-limit stop: no straggler, nothing to exclude
    (run / "logs" / "stragglers.jsonl").write_text(
        json.dumps({"time": "t", "step": 40, "rank": 1, "host": "vm", "node": "n7", "ratio": 3.0, "windows": 10}) + "\n"
    )
    calls.unlink()
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "kforge: job 42 excludes node(s): n7" in r.stdout, r.stdout + r.stderr
    assert "kforge: excluding n7 (straggler: rank 1 (host vm) 3.0x the median" in r.stderr
    lines = calls.read_text().splitlines()
    assert lines[-3:] == ["show partition gpu -o", "requeue 42", "update JobId=42 ExcNodeList=n7"], lines


def test_a_rank_without_a_report_gets_its_node_from_the_slurm_layout() -> None:
    from kforge_cli.engine.resilience.hang_report import expand_hostlist, slurm_rank_nodes

    assert expand_hostlist("gpu[08-10,12],login1,n[1-2]") == ["gpu08", "gpu09", "gpu10", "gpu12", "login1", "n1", "n2"]
    assert expand_hostlist("n[a-b]") == []
    env = {"SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    assert slurm_rank_nodes(env) == ["n1", "n1", "n2", "n2", "n3"]
    assert slurm_rank_nodes({"SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}) == []
    assert slurm_rank_nodes({}) == []


def test_stopped_json_names_the_node_of_a_silent_rank_from_the_layout(tmp_path: Path) -> None:
    d = tmp_path / "hang"
    _reports(d)
    (d / "rank_1.json").unlink()  # rank 1 wrote nothing (stuck holding the GIL, or gone)
    env = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    (entry,) = stopped_record(d, 2, env)["ranks"]  # type: ignore[misc]
    assert entry["rank"] == 1 and entry["node"] == "n2" and entry["node_from"] == "layout"
    assert stopped_record(d, 2, {})["ranks"][0]["node"] is None  # type: ignore[index]


def test_a_job_that_may_shrink_needs_only_its_minimum_nodes_when_excluding() -> None:
    """With slurm.min_nodes the cap leaves room for the minimum, not the full size (issue 46, shrink + exclude)."""
    from kforge_cli.slurm.sbatch import exclude_command

    def need(*overrides: str) -> str:
        slurm = load_settings(overrides=list(overrides), use_env=False).settings.slurm
        cmd = exclude_command(Path("/r"), "python", slurm)
        return cmd[cmd.index("--need-nodes") + 1]

    assert need("--slurm.nodes=4") == "4"
    assert need("--slurm.nodes=4", "--slurm.min_nodes=2") == "2"
