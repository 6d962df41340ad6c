"""fp16 loss scaling: an overflowing step is skipped without touching the weights, and the
scaler's state (scale, growth tracker, skipped-step count) survives a checkpoint exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.observe import read_metrics
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train import TrainHook, run_training
from kforge_cli.engine.train.step import plain_step
from kforge_cli.engine.train.update import LossScaler, apply_update
from kforge_cli.settings.rules import world_size_issues
from tests.helpers.tiny_run import tiny_session, tiny_settings
from tests.unit.test_train_step import NoData, make_batch

FP16 = ["--train.mixed_precision=fp16"]


def test_an_inf_gradient_skips_the_step_and_halves_the_scale(tmp_path: Path) -> None:
    session = tiny_session(tmp_path, tiny_settings(*FP16), data=NoData())
    assert session.grad_scaler is not None
    weight = session.model.norm.weight
    remove = weight.register_hook(lambda g: g * float("inf"))  # an fp16 overflow in one gradient
    before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    result = plain_step(session, [make_batch()])
    skipped = apply_update(session, 1, result)
    numbers = result.read()
    assert bool(skipped) and numbers.grad_norm == float("inf") and numbers.loss == pytest.approx(numbers.loss)
    for name, p in session.model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    assert session.grad_scaler.metrics() == {"scaler/scale": 2.0**15, "scaler/skipped_steps": 1.0}
    # the next clean step is applied, with gradients in true units (unscaled before clipping)
    remove.remove()
    session.optimizer.zero_grad(set_to_none=True)
    result = plain_step(session, [make_batch()])
    assert not bool(apply_update(session, 2, result))
    assert 0 < result.read().grad_norm < 100
    assert not torch.equal(weight, before["norm.weight"])


class OverflowAt(TrainHook):
    """Overflows one gradient at step `overflow` and asks the run to stop after step `stop` (a SIGTERM's flag)."""

    def __init__(self, overflow: int, stop: int | None = None) -> None:
        self.overflow, self.stop = overflow, stop

    def on_train_begin(self, session: Any) -> None:
        def poison(grad: torch.Tensor) -> torch.Tensor:
            return grad * float("inf") if session.state.step + 1 == self.overflow else grad

        session.model.norm.weight.register_hook(poison)

    def on_step_end(self, session: Any, info: Any) -> None:
        if info.step == self.stop:
            session.shutdown.signal_name = "SIGTERM"


def _records(run_dir: Path) -> dict[int, dict[str, Any]]:
    keys = ("loss", "grad_norm", "scaler/scale", "scaler/skipped_steps")
    return {r["step"]: {k: r[k] for k in keys} for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_fp16_run_stopped_and_resumed_is_bit_exact_with_the_scaler_state(tmp_path: Path) -> None:
    args = [
        *FP16,
        "--model.vocab_size=320",  # the built-in corpus is byte-tokenized
        "--train.batch_size=2",
        "--train.max_steps=6",
        "--metrics.log_interval=1",
        "--metrics.progress_bar=off",
        "--eval.interval=0",
        "--checkpoint.interval=0",
        "--train.num_threads=1",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_training(tiny_settings(*args, f"--train.run_dir={ref}"), hooks=[OverflowAt(2)])
    stopped = run_training(tiny_settings(*args, f"--train.run_dir={run}"), hooks=[OverflowAt(2, stop=3)])
    assert stopped.status == "stopped" and stopped.step == 3
    saved = json.loads((run / "checkpoints" / "step_3" / "train_state.json").read_text())["parts"]["update"][
        "loss_scale"
    ]
    assert saved["scale"] == 2.0**15 and saved["_growth_tracker"] == 1 and saved["skipped_steps"] == 1
    run_training(tiny_settings(*args, f"--train.run_dir={run}"), hooks=[OverflowAt(0)])
    want, got = _records(ref), _records(run)
    assert sorted(got) == list(range(1, 7)) and got == want  # bit for bit, the scale and skip count too
    assert want[2]["scaler/skipped_steps"] == 1 and want[6]["scaler/scale"] == 2.0**15


def test_a_hostile_scaler_state_is_refused(tmp_path: Path) -> None:
    scaler = LossScaler(init_runtime(tiny_settings(*FP16)))
    good = {**scaler.state_dict()}
    scaler.load_state_dict(good)
    for bad in ({**good, "scale": float("nan")}, {**good, "scale": -1.0}, {**good, "_growth_tracker": "1"}, []):
        with pytest.raises(CheckpointError, match="grad_scaler"):
            scaler.load_state_dict(bad)


@pytest.mark.parametrize("mode", ["--distributed.pp=2", "--distributed.tp=2"])
def test_fp16_is_refused_where_loss_scaling_is_not_built(mode: str) -> None:
    s = tiny_settings(*FP16, mode, "--train.grad_accum_steps=2")
    fields = [issue.path for issue in world_size_issues(s, 2)]
    assert "train.mixed_precision" in fields
    assert "train.mixed_precision" not in [i.path for i in world_size_issues(tiny_settings(*FP16), 2)]
