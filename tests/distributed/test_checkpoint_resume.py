"""Checkpoints across processes: 2-rank FSDP SIGTERM/resume bit for bit, and resharding to 1, 4 and tp=2.

Each rank is a real `kforge train` process (RANK/WORLD_SIZE set as torchrun would), so
every rank's exit code is visible: all must be 75 after a signal that only rank 1 got.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kforge_cli.engine.checkpoint import read_latest
from tests.e2e.test_resume import ARGS, ENV, HOOK, NO_HOOK, Payload, losses
from tests.helpers.launch import kforge_ranks

pytestmark = pytest.mark.distributed

# 2 ranks x batch 8 = 16 sequences per step; async saves every 3 steps, all kept.
REF_ARGS = [
    *ARGS,
    "--train.max_steps=12",
    "--checkpoint.interval=3",
    "--checkpoint.keep_last_n=0",
    "--checkpoint.async_mode=async",
]


def launch(world: int, run_dir: Path, args: list[str], env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """Start `world` ranks of `kforge train`; (exit code, log) per rank."""
    return kforge_ranks(world, run_dir, args, {**ENV, **(env or {})})


def ok(results: list[tuple[int, str]], code: int = 0) -> None:
    for rank, (rc, log) in enumerate(results):
        assert rc == code, f"rank {rank} exited {rc}:\n{log[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank FSDP run of 12 steps, with checkpoints at 3, 6, 9, 12."""
    run = tmp_path_factory.mktemp("ref") / "run"
    ok(launch(2, run, REF_ARGS))
    assert len(losses(run)) == 12
    return run


def test_two_rank_fsdp_sigterm_on_one_rank_then_resume_is_bit_exact(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    stopped = launch(2, run, [*REF_ARGS, HOOK], {"KFORGE_TEST_SIGTERM_STEP": "4", "KFORGE_TEST_SIGTERM_RANK": "1"})
    # signalled after step 4; the ranks vote every resilience.stop_check_interval = 5 steps: both stop after 5
    ok(stopped, 75)
    # rank 0 tells the console; rank 1 keeps its line in its own log
    assert "stopped by peer signal at step 5" in stopped[0][1]
    assert "stopped by SIGTERM at step 5" in (run / "logs" / "rank_1.log").read_text()
    assert read_latest(run / "checkpoints") == run / "checkpoints" / "step_5"
    resumed = launch(2, run, [*REF_ARGS, NO_HOOK])
    ok(resumed)
    assert f"resumed from {run / 'checkpoints' / 'step_5'} (step 5)" in resumed[0][1]
    assert losses(run) == losses(reference)  # all 12 steps, bit for bit


@pytest.mark.parametrize(
    ("world", "extra"),
    [
        (1, ["--train.batch_size=16"]),
        (4, ["--train.batch_size=4"]),
        (2, ["--train.batch_size=16", "--distributed.tp=2"]),
    ],
    ids=["world1", "world4", "tp2"],
)
def test_checkpoint_from_two_rank_fsdp_resumes_at_another_layout(
    reference: Path, tmp_path: Path, world: int, extra: list[str]
) -> None:
    """The same global batch of 16 at another world size or mesh: DCP reshards, the data order re-partitions."""
    run = tmp_path / "run"
    load = f"--checkpoint.load_path={reference / 'checkpoints' / 'step_6'}"
    results = launch(world, run, [*REF_ARGS, *extra, load])
    ok(results)
    assert f"resumed from {reference / 'checkpoints' / 'step_6'} (step 6)" in results[0][1]
    ref, got = losses(reference), losses(run)
    assert sorted(got) == list(range(7, 13))
    for step in got:  # only the order of floating-point reductions differs
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=0), (step, got[step], ref[step])


def test_pipeline_stages_save_own_dirs_and_resume_without_pipeline(reference: Path, tmp_path: Path) -> None:
    """pp=2 (one stage per rank) stopped by SIGTERM at step 3, resumed on one process: the curve continues."""
    run, pp = (
        tmp_path / "run",
        ["--distributed.pp=2", "--train.grad_accum_steps=2", "--resilience.stop_check_interval=1"],
    )
    stopped = launch(2, run, [*REF_ARGS, *pp, HOOK], {"KFORGE_TEST_SIGTERM_STEP": "3", "KFORGE_TEST_SIGTERM_RANK": "0"})
    ok(stopped, 75)
    step_dir = run / "checkpoints" / "step_3"
    assert sorted(p.name for p in step_dir.glob("pp_*")) == ["pp_0", "pp_1"]
    assert all((step_dir / f"pp_{s}" / ".metadata").is_file() for s in (0, 1))
    assert not (step_dir / ".metadata").exists()
    # the layout change is typed (--distributed.pp=1), as a relaunch of a run must
    unpiped = ["--distributed.pp=1", "--resilience.stop_check_interval=1", NO_HOOK]
    resumed = launch(1, run, [*REF_ARGS, "--train.batch_size=8", "--train.grad_accum_steps=2", *unpiped])
    ok(resumed)
    assert f"resumed from {step_dir} (step 3)" in resumed[0][1]
    ref, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, 13))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=0), (step, got[step], ref[step])


def test_hostile_train_state_on_one_rank_stops_every_rank(reference: Path, tmp_path: Path) -> None:
    """Only rank 1's RNG file carries a payload: rank 0's pre-resume check refuses it for every rank (no hang)."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(reference, run)
    torch.save({"torch_cpu": Payload(marker)}, run / "checkpoints" / "step_12" / "train_state" / "rank_1.pt")
    results = launch(2, run, [*REF_ARGS, "--train.max_steps=14"])  # more to do: the checkpoint must load
    ok(results, 2)
    assert f"refusing to load {run / 'checkpoints' / 'step_12' / 'train_state' / 'rank_1.pt'}" in results[1][1]
    assert f"refusing to load {run / 'checkpoints' / 'step_12' / 'train_state' / 'rank_1.pt'}" in results[0][1]
    assert not marker.exists()
