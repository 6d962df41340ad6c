"""MoE checkpoints under expert parallelism: SIGTERM/resume bit for bit, and resharding between EP degrees.

One uninterrupted 2-rank EP=2 run (checkpoints at 3 and 6) is the reference. From it:
an EP=2 run stopped by SIGTERM on one rank resumes to the same losses bit for bit; its
step-3 checkpoint resumes on one process (EP=1) and on 4 ranks (EP=4, each holding one
expert) and the curve continues (same global batch; only the order of float sums
differs); and the one-process continuation, stopped by SIGTERM and resumed, is bit-exact. A pipeline
(pp=2) MoE run stopped by SIGTERM resumes bit for bit too (biases restored per stage, the
schedule's shape inference after the restart not counted as load).
Each rank is a real ``kforge train`` process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kforge_cli.engine.checkpoint import read_latest
from tests.distributed.test_checkpoint_resume import launch, ok
from tests.e2e.test_resume import HOOK, NO_HOOK, losses
from tests.helpers import tiny

pytestmark = pytest.mark.distributed

# 2 ranks x batch 4 = 8 sequences per step; 2 MoE blocks of 4 experts (2 per EP=2 rank).
MOE_ARGS = [
    *tiny.GQA32,
    *tiny.moe(z_loss_weight=None),
    "--train.seq_len=32",
    "--train.batch_size=4",
    "--train.max_steps=6",
    "--scheduler.warmup_steps=2",
    *tiny.QUIET,
    "--checkpoint.interval=3",
    "--checkpoint.keep_last_n=0",
    "--resilience.stop_check_interval=1",  # ranks agree to stop at the step the signal lands in
]
EP2 = [*MOE_ARGS, "--distributed.ep=2"]
PP2 = [*MOE_ARGS, "--distributed.pp=2", "--train.grad_accum_steps=2"]  # one MoE block per stage


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ep_ref") / "run"
    ok(launch(2, run, [*EP2, NO_HOOK]))
    assert len(losses(run)) == 6
    return run


def _sigterm(step: int, rank: int) -> dict[str, str]:
    return {"KFORGE_TEST_SIGTERM_STEP": str(step), "KFORGE_TEST_SIGTERM_RANK": str(rank)}


def test_ep2_sigterm_then_resume_is_bit_exact(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    stopped = launch(2, run, [*EP2, HOOK], _sigterm(4, 1))
    ok(stopped, 75)
    assert read_latest(run / "checkpoints") == run / "checkpoints" / "step_4"
    ok(launch(2, run, [*EP2, NO_HOOK]))
    assert losses(run) == losses(reference)  # all 6 steps, bit for bit


@pytest.mark.parametrize(("world", "extra"), [(1, ["--train.batch_size=8"]), (4, ["--train.batch_size=2"])])
def test_ep2_checkpoint_resumes_at_another_ep_degree(
    reference: Path, tmp_path: Path, world: int, extra: list[str]
) -> None:
    """EP=2 -> EP=1 (one process) and -> EP=4 (one expert per rank): DCP reshards the Shard(0) experts."""
    run, step3 = tmp_path / "run", reference / "checkpoints" / "step_3"
    args = [*MOE_ARGS, *extra, f"--distributed.ep={world}", f"--checkpoint.load_path={step3}"]
    ok(launch(world, run, args))
    ref, got = losses(reference), losses(run)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=0), (step, got[step], ref[step])
    if world == 1:  # the one-process MoE continuation: SIGTERM at step 5 and resume, bit for bit
        again = tmp_path / "again"
        ok(launch(1, again, [*args, HOOK], _sigterm(5, 0)), 75)
        ok(launch(1, again, [*args, NO_HOOK]))  # the same command again: it resumes its own step_5, not load_path
        resumed = losses(again)
        assert {step: resumed[step] for step in got} == got


def test_pp2_sigterm_then_resume_is_bit_exact(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(launch(2, ref, PP2))
    ok(launch(2, run, [*PP2, HOOK], _sigterm(4, 1)), 75)  # rank 1: the last stage
    assert read_latest(run / "checkpoints") == run / "checkpoints" / "step_4"
    ok(launch(2, run, [*PP2, NO_HOOK]))
    assert len(losses(ref)) == 6 and losses(run) == losses(ref)  # all 6 steps, bit for bit
