"""The real `kforge` on VLM jobs: the vlm-mot-debug profile and the other archs learn, a mid-schedule resume
is bit-exact, a changed freeze plan is refused naming the module, convert-mot output is a usable checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_resume import ENV, HOOK, NO_HOOK, losses
from tests.helpers import tiny

pytestmark = pytest.mark.e2e

QUIET = [*tiny.QUIET, "--checkpoint.interval=0"]
SCHEDULE = '--vlm.freeze_schedule=[{start_step=0, freeze=["vision"]}, {start_step=4, freeze=["adapter"]}]'


@pytest.mark.parametrize("arch", ["mot", "joint_decoder", "cross_attention"])
def test_vlm_trains_and_the_loss_falls(kforge, tmp_path: Path, arch: str) -> None:
    run = tmp_path / "run"
    r = kforge(
        "train",
        "--profile",
        "vlm-mot-debug",
        "--run-dir",
        str(run),
        f"--vlm.arch={arch}",
        "--vlm.cross_attention_every=2",
        "--train.max_steps=30",
        "--scheduler.warmup_steps=5",
        "--checkpoint.save_final=false",
        *QUIET,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(run)
    first, last = got[1], sum(got[s] for s in range(26, 31)) / 5
    assert first > 5.0 and last < 0.5 * first, (first, last)


def test_mid_schedule_resume_is_bit_exact_and_a_changed_freeze_is_refused(kforge, tmp_path: Path) -> None:
    args = [
        "--profile",
        "vlm-mot-debug",
        "--train.max_steps=8",
        "--scheduler.warmup_steps=2",
        "--train.batch_size=4",
        SCHEDULE,
        *QUIET,
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = kforge("train", "--run-dir", str(ref), *args, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    frozen = {
        rec["step"]: rec["frozen_params"]
        for rec in map(json.loads, (ref / "metrics.jsonl").open())
        if "frozen_params" in rec
    }
    assert frozen[1] == frozen[4] > 0 and frozen[5] != frozen[4]  # vision until step 4, then the adapter
    stopped = kforge("train", "--run-dir", str(run), *args, HOOK, env={**ENV, "KFORGE_TEST_SIGTERM_STEP": "3"})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    resumed = kforge("train", "--run-dir", str(run), *args, NO_HOOK, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 3)" in resumed.stderr
    assert losses(run) == losses(ref)  # bit for bit, across the unfreeze at step 5
    changed = kforge(
        "train",
        "--run-dir",
        str(run),
        *[a for a in args if a != SCHEDULE],
        "--train.max_steps=10",
        '--vlm.freeze_schedule=[{start_step=0, freeze=["vision"]}]',
        env=ENV,
    )
    assert changed.returncode == 2
    assert "module adapter frozen in the checkpoint's run but trained in this one" in changed.stderr
    assert "module vision frozen in this run" in changed.stderr
    forced = kforge(
        "train",
        "--run-dir",
        str(run),
        *[a for a in args if a != SCHEDULE],
        "--train.max_steps=9",
        '--vlm.freeze_schedule=[{start_step=0, freeze=["vision"]}]',
        "--vlm.allow_freeze_mismatch=true",
        env=ENV,
    )
    assert forced.returncode == 0, forced.stderr[-3000:]


def test_convert_mot_then_warm_start_and_resume(kforge, tmp_path: Path) -> None:
    small = ["--model.dim=64", "--model.n_layers=2", "--train.num_threads=1"]
    dense = tmp_path / "dense"
    r = kforge(
        "train", "--run-dir", str(dense), *small, "--train.max_steps=2", "--scheduler.warmup_steps=1", *QUIET, env=ENV
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "mot"
    r = kforge("convert-mot", str(dense), str(out), *small, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    info = kforge("inspect-ckpt", str(out), "--json", env=ENV)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "layers.1.experts.image.attention.wq.weight" in info.stdout
    again = kforge("convert-mot", str(dense), str(out), *small, env=ENV)
    assert again.returncode == 2 and "not empty" in again.stderr
    init = kforge(
        "train",
        "--profile",
        "vlm-mot-debug",
        "--run-dir",
        str(tmp_path / "init"),
        *small,
        f"--checkpoint.init_from={out}",
        "--train.max_steps=2",
        "--scheduler.warmup_steps=1",
        *QUIET,
        env=ENV,
    )
    assert init.returncode == 0, init.stderr[-3000:]
    warm = tmp_path / "warm"
    base = [
        "--profile",
        "vlm-mot-debug",
        "--run-dir",
        str(warm),
        *small,
        f"--vlm.mot_warm_start_from={dense}",
        "--scheduler.warmup_steps=1",
        *QUIET,
    ]
    r = kforge("train", *base, "--train.max_steps=2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MoT warm start:" in r.stderr
    assert losses(warm)[1] == losses(tmp_path / "init")[1]  # same weights: convert-mot == warm start at step 0
    r = kforge("train", *base, "--train.max_steps=3", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vlm.mot_warm_start_from not applied: the run resumed" in r.stderr and "MoT warm start:" not in r.stderr
