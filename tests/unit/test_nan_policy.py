"""NaN/Inf policy through the real loop: warn applies, skip drops the update, abort stops.

Each runs twice: with foreach AdamW the guard reads the loss and norm every step; with
fused AdamW it decides on the device (the kernel's ``found_inf``) and reads its tallies
only on logging steps (every step here), with the same outcome.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kforge_cli.engine.train import run_training
from kforge_cli.engine.train.optim.scheduler import lr_multiplier
from kforge_cli.errors import TrainingAborted
from kforge_cli.settings import load_settings
from tests.helpers import tiny
from tests.helpers.nan_hooks import InjectNaN

TINY = [
    *tiny.model(32, 2, 4),
    "--train.seq_len=32",
    "--train.batch_size=4",
    "--train.max_steps=8",
    "--scheduler.warmup_steps=2",
    *tiny.QUIET,
    "--checkpoint.interval=0",
]


def settings(tmp_path: Path, *extra: str):
    return load_settings(overrides=[*TINY, f"--train.run_dir={tmp_path / 'run'}", *extra]).settings


OPTIMIZERS = pytest.mark.parametrize("fused", ["false", "true"], ids=["host-decides", "device-decides"])


@OPTIMIZERS
def test_skip_drops_the_update_and_keeps_the_schedule(tmp_path: Path, fused: str) -> None:
    hook = InjectNaN({3, 4})
    s = settings(tmp_path, "--resilience.nan_policy=skip", f"--optimizer.fused={fused}")
    outcome = run_training(s, hooks=[hook])
    assert outcome.status == "completed" and outcome.step == 8
    assert hook.skipped == [3, 4]
    assert math.isnan(hook.losses[3]) and all(math.isfinite(hook.losses[k]) for k in (1, 2, 5, 6, 7, 8))
    # the skipped steps did not change the parameters ...
    torch.testing.assert_close(hook.params_before[4], hook.params_before[2], rtol=0, atol=0)
    assert not torch.equal(hook.params_before[5], hook.params_before[4])
    # ... and the LR of every step is the schedule's value for that step: no drift
    for step, lr in hook.lrs.items():
        assert lr == pytest.approx(s.optimizer.lr * lr_multiplier(step - 1, s.scheduler, 8), rel=1e-9)


@OPTIMIZERS
def test_warn_applies_the_update(tmp_path: Path, fused: str) -> None:
    hook = InjectNaN({3})
    outcome = run_training(
        settings(tmp_path, "--resilience.nan_policy=warn", f"--optimizer.fused={fused}"), hooks=[hook]
    )
    assert outcome.status == "completed" and hook.skipped == []
    assert torch.isnan(hook.params_before[3]).any()  # the user asked for it


@OPTIMIZERS
def test_abort_after_n_consecutive(tmp_path: Path, fused: str) -> None:
    hook = InjectNaN({3, 5, 6})
    s = settings(
        tmp_path, "--resilience.nan_policy=abort", "--resilience.nan_max_consecutive=2", f"--optimizer.fused={fused}"
    )
    with pytest.raises(TrainingAborted, match="2 consecutive bad step"):
        run_training(s, hooks=[hook])
    assert hook.skipped == [3, 5]  # step 3 alone is tolerated; 5 and 6 in a row abort at 6
