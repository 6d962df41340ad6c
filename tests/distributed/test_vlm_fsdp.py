"""VLM under 2-rank FSDP2 on CPU (gloo): the MoT profile trains like one process, a freeze schedule
really unfreezes the encoder at step S, and a mid-schedule resume is bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kforge_cli.engine.checkpoint.reader import open_checkpoint, read_tensors
from kforge_cli.engine.model.vlm import build_vlm
from kforge_cli.settings import load_settings
from tests.conftest import run_kforge
from tests.distributed.test_checkpoint_resume import launch, ok
from tests.e2e.test_resume import ENV, losses
from tests.helpers import tiny

pytestmark = pytest.mark.distributed

BASE = ["--profile", "vlm-mot-debug", "--scheduler.warmup_steps=2", *tiny.QUIET]
# Encoder frozen for the updates after steps 0..2, trained from the update after step 3 on (update 4).
UNFREEZE_AT = 3
SCHEDULE = f'--vlm.freeze_schedule=[{{start_step=0, freeze=["vision"]}}, {{start_step={UNFREEZE_AT}, freeze=[]}}]'


def test_mot_profile_on_two_fsdp_ranks_trains_like_one_process(tmp_path: Path) -> None:
    args = [*BASE, "--train.max_steps=12", "--checkpoint.interval=0", "--checkpoint.save_final=false"]
    ok(launch(2, tmp_path / "fsdp", [*args, "--train.batch_size=4"]))
    single = run_kforge("train", "--run-dir", str(tmp_path / "single"), *args, "--train.batch_size=8", env=ENV)
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = losses(tmp_path / "fsdp"), losses(tmp_path / "single")
    assert sorted(two) == list(range(1, 13))
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-4 * one[step], (step, two[step], one[step])
    assert two[1] > 5.0 and two[12] < 0.75 * two[1]


def _vision(step_dir: Path) -> dict[str, torch.Tensor]:
    view = open_checkpoint(step_dir)
    keys = [k for k in view.tensors if k.startswith("model.vision.")]
    return read_tensors(view, keys)


@pytest.fixture(scope="module")
def schedule_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2-rank FSDP, freeze schedule, a checkpoint after every step."""
    run = tmp_path_factory.mktemp("sched") / "run"
    ok(
        launch(
            2,
            run,
            [
                *BASE,
                SCHEDULE,
                "--train.max_steps=5",
                "--train.batch_size=4",
                "--checkpoint.interval=1",
                "--checkpoint.keep_last_n=0",
            ],
        )
    )
    return run


def test_encoder_is_unchanged_before_the_unfreeze_and_trains_after(schedule_run: Path) -> None:
    ckpts = schedule_run / "checkpoints"
    steps = {s: _vision(ckpts / f"step_{s}") for s in range(1, 6)}
    settings = load_settings(overrides=BASE[2:], profile="vlm-mot-debug", use_env=False).settings
    torch.manual_seed(settings.train.seed)
    initial = {f"model.{n}": p.detach() for n, p in build_vlm(settings).named_parameters() if n.startswith("vision.")}
    assert set(initial) == set(steps[1]) and initial
    for s in range(1, UNFREEZE_AT + 1):  # updates 1..3: frozen
        assert all(torch.equal(steps[s][k], initial[k]) for k in initial), s
    for s in range(UNFREEZE_AT + 1, 6):  # updates 4, 5: trained
        changed = [k for k in initial if not torch.equal(steps[s][k], steps[s - 1][k])]
        assert len(changed) == len(initial), (s, sorted(set(initial) - set(changed))[:3])
    adapter = [open_checkpoint(ckpts / f"step_{s}") for s in (1, 2)]
    key = "model.adapter.fc1.weight"
    assert not torch.equal(read_tensors(adapter[0], [key])[key], read_tensors(adapter[1], [key])[key])


def test_mid_schedule_resume_on_two_fsdp_ranks_is_bit_exact(schedule_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "resumed"
    start = schedule_run / "checkpoints" / "step_2"
    ok(
        launch(
            2,
            run,
            [
                *BASE,
                SCHEDULE,
                "--train.max_steps=5",
                "--train.batch_size=4",
                "--checkpoint.interval=0",
                f"--checkpoint.load_path={start}",
            ],
        )
    )
    ref, got = losses(schedule_run), losses(run)
    assert sorted(got) == [3, 4, 5]
    assert all(got[s] == ref[s] for s in got), (got, ref)
