"""Shrink instead of waiting (slurm.min_nodes): the re-plan decision, its refusals, the sbatch's --nodes=MIN-MAX."""

from __future__ import annotations

from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from kforge_cli.engine.plan.shrink_replan import replan_for_world
from kforge_cli.errors import ConfigError
from kforge_cli.settings import JobSettings, load_settings, resolve_dims
from kforge_cli.settings.shrink import check_world, shrink_applies, unkept_node_counts
from kforge_cli.slurm.sbatch import render_sbatch
from tests.helpers import tiny


def settings(*extra: str) -> JobSettings:
    return load_settings(overrides=[*tiny.TINY_MODEL, *extra], use_env=False).settings


def layout(s: JobSettings, world: int) -> tuple[int, int, int, int, int, int]:
    dims = resolve_dims(s, world)
    return dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, s.train.grad_accum_steps


# 4 nodes x 2 GPUs, micro-batch 4, accumulation 1: 8 data-parallel groups, a global batch of 32 sequences
FOUR_NODES = ("--slurm.nodes=4", "--slurm.gpus_per_node=2", "--slurm.min_nodes=1", "--train.batch_size=4")


@pytest.mark.parametrize(
    ("world", "extra", "want"),
    [
        (4, (), (1, 4, 1, 1, 1, 2)),  # 2 of 4 nodes: FSDP over what is left, accumulation doubled
        (2, (), (1, 2, 1, 1, 1, 4)),
        (6, ("--distributed.dp_shard=2", "--distributed.dp_replicate=4"), None),  # 32 / (4 x 3) is no whole number
        (4, ("--distributed.dp_shard=2", "--distributed.dp_replicate=4"), (2, 2, 1, 1, 1, 2)),  # HSDP: shard kept
        (4, ("--distributed.tp=2",), (1, 2, 2, 1, 1, 2)),  # tp kept; 4 dp groups -> 2
        (2, ("--distributed.pp=2", "--train.grad_accum_steps=2"), (1, 1, 1, 2, 1, 8)),  # pp kept
    ],
    ids=["half", "quarter", "not-whole", "hsdp", "tp", "pp"],
)
def test_replan_scales_data_parallel_and_keeps_the_global_batch(
    world: int, extra: tuple[str, ...], want: tuple[int, ...] | None
) -> None:
    s = settings(*FOUR_NODES, *extra)
    full = resolve_dims(s, 8)
    global_batch = s.train.batch_size * s.train.grad_accum_steps * full.dp
    if want is None:
        with pytest.raises(ConfigError) as err:
            replan_for_world(s, world)
        text = str(err.value)
        assert "train.grad_accum_steps" in text and f"global batch of {global_batch} sequences" in text
        assert "is not a whole number of accumulation steps" in text and err.value.exit_code == 2
        return
    choice = replan_for_world(s, world)
    assert choice is not None and choice.shrunk and choice.configured is s
    got = choice.settings
    assert layout(got, world) == want
    dims = resolve_dims(got, world)
    assert got.train.batch_size * got.train.grad_accum_steps * dims.dp == global_batch == choice.global_batch
    assert "slurm.min_nodes" in choice.reason and f"global batch {global_batch} sequences kept" in choice.reason
    assert choice.peak_bytes is not None and 0 < choice.peak_bytes < s.slurm.gpu_memory_gb * 2**30


def test_full_size_is_the_configured_layout_and_off_means_no_policy() -> None:
    s = settings(*FOUR_NODES)
    choice = replan_for_world(s, 8)  # the nodes came back: grow to the configured layout
    assert choice is not None and not choice.shrunk and choice.settings is s
    assert replan_for_world(settings("--slurm.nodes=4", "--slurm.gpus_per_node=2"), 4) is None  # off
    assert replan_for_world(s, 16) is None  # above the full size: not the policy's (the usual rules apply)
    assert not shrink_applies(settings("--slurm.nodes=4", "--slurm.min_nodes=4"), 1)  # min = max: nothing to shrink


def test_refusals_name_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"tp x pp x cp = 1 x 1 x 4 = 4 is kept and does not divide the world size 2"):
        replan_for_world(settings(*FOUR_NODES, "--distributed.cp=4"), 2)
    with pytest.raises(ConfigError, match=r"no layout for the job's 2 processes fits the GPU memory") as err:
        replan_for_world(settings(*FOUR_NODES, "--slurm.gpu_memory_gb=0.0001"), 2)
    assert "slurm.gpu_memory_gb: dp_shard=2: the memory plan's peak" in str(err.value)
    with pytest.raises(ConfigError, match=r"slurm.min_nodes: 5 is above slurm.nodes \(4\)"):
        load_settings(overrides=[*tiny.TINY_MODEL, "--slurm.nodes=4", "--slurm.min_nodes=5"], use_env=False)
    # the local launcher's check before it starts processes: re-planned, not "does not fit world size"
    check_world(settings(*FOUR_NODES, "--distributed.dp_shard=8"), 4)
    with pytest.raises(ConfigError, match="does not fit world size 4"):
        check_world(settings("--slurm.nodes=4", "--slurm.gpus_per_node=2", "--distributed.dp_shard=8"), 4)


def test_a_local_job_that_cannot_keep_the_global_batch_is_refused_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run), *tiny.TINY_MODEL, "--slurm.nodes=3", "--slurm.min_nodes=1"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--train.batch_size=4", "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and not run.exists()
    assert "slurm.min_nodes: cannot re-plan the job for its 2 processes" in err
    assert (
        "the global batch of 12 sequences (train.batch_size 4 x grad_accum_steps 1 x 3 data-parallel groups at " in err
    )
    assert "the configured 3 processes (slurm.nodes=3 x gpus_per_node=1)) cannot be kept exactly" in err


def test_node_counts_slurm_may_give_that_cannot_keep_the_global_batch_are_warned_about() -> None:
    # 8 nodes x 8 GPUs, tp 2, micro-batch 1 x 2: a global batch of 64 over 32 data-parallel groups
    base = ("--slurm.nodes=8", "--slurm.gpus_per_node=8", "--distributed.tp=2", "--train.batch_size=1")
    resolved = load_settings(
        overrides=[*tiny.TINY_MODEL, *base, "--train.grad_accum_steps=2", "--slurm.min_nodes=4"], use_env=False
    )
    assert unkept_node_counts(resolved.settings) == [5, 6, 7]
    (warning,) = [w for w in resolved.warnings if w.path == "slurm.min_nodes"]
    assert "SLURM may start the job on 5, 6, 7 of its 8 nodes (--nodes=4-8)" in warning.message
    assert "global batch of 64 sequences cannot be kept exactly" in warning.message
    assert "set slurm.min_nodes=8" in warning.message
    assert unkept_node_counts(settings(*base, "--train.grad_accum_steps=60", "--slurm.min_nodes=4")) == [7]
    assert unkept_node_counts(settings(*base, "--train.grad_accum_steps=60", "--slurm.min_nodes=5")) == [7]
    assert unkept_node_counts(settings(*FOUR_NODES)) == [3]  # 32 sequences over 6 groups


def test_sbatch_asks_for_min_to_max_nodes(tmp_path: Path) -> None:
    def nodes_line(*extra: str) -> list[str]:
        script = render_sbatch(settings(*extra), tmp_path, python="/usr/bin/python3", workdir=tmp_path)
        return [line for line in script.splitlines() if line.startswith("#SBATCH --nodes")]

    assert nodes_line("--slurm.nodes=4", "--slurm.min_nodes=2") == ["#SBATCH --nodes=2-4"]
    assert (
        nodes_line("--slurm.nodes=4") == nodes_line("--slurm.nodes=4", "--slurm.min_nodes=4") == ["#SBATCH --nodes=4"]
    )
