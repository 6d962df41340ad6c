"""VLM under 2-rank tensor parallelism (no sequence parallelism): the same losses as one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_kforge
from tests.distributed.test_checkpoint_resume import launch, ok
from tests.e2e.test_resume import ENV, losses
from tests.helpers import tiny

pytestmark = pytest.mark.distributed

ARGS = [
    "--profile",
    "vlm-mot-debug",
    "--vlm.cross_attention_every=1",
    "--train.max_steps=4",
    "--scheduler.warmup_steps=2",
    *tiny.QUIET,
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
]


@pytest.mark.parametrize("arch", ["joint_decoder", "cross_attention"])
def test_tp2_vlm_matches_one_process(tmp_path: Path, arch: str) -> None:
    args = [*ARGS, f"--vlm.arch={arch}"]
    ok(launch(2, tmp_path / "tp", [*args, "--distributed.tp=2", "--distributed.sequence_parallel=false"]))
    single = run_kforge("train", "--run-dir", str(tmp_path / "one"), *args, env=ENV)
    assert single.returncode == 0, single.stderr[-3000:]
    tp, one = losses(tmp_path / "tp"), losses(tmp_path / "one")
    assert sorted(tp) == [1, 2, 3, 4]
    for step, loss in one.items():
        assert abs(tp[step] - loss) <= 1e-5 * loss, (step, tp[step], loss)
