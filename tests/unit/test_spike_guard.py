"""The loss-spike guard through the real loop (one process): rewind skips the spike's data, warn reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.observe import read_metrics
from kforge_cli.engine.resilience import SpikeGuard
from kforge_cli.engine.train import TrainHook, run_training
from kforge_cli.settings import load_settings

TINY = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--train.seq_len=32",
    "--train.batch_size=4",
    "--train.max_steps=40",
    "--scheduler.warmup_steps=2",
    "--eval.interval=0",
    "--metrics.log_interval=1",
    "--metrics.progress_bar=off",
    "--checkpoint.interval=10",
    "--checkpoint.keep_last_n=0",
    "--resilience.spike_window=8",
]
SPIKE = 25  # the hook scales the update of step 24 (its loss is step 24's); step 25's loss shows it


class ScaleLROnce(TrainHook):
    """Multiplies the learning rate of one optimizer step (once per run): a bad update, then a spike."""

    def __init__(self, step: int, factor: float = 300.0) -> None:
        self.step, self.factor, self.done = step, factor, False

    def on_step_end(self, session: Any, info: Any) -> None:
        if not self.done and info.step == self.step - 1:  # the scheduler already set the next step's LR
            self.done = True
            for group in session.optimizer.param_groups:
                group["lr"] *= self.factor


def _settings(run: Path, *extra: str) -> Any:
    return load_settings(overrides=[*TINY, f"--train.run_dir={run}", *extra]).settings


def _records(run: Path) -> list[dict[str, Any]]:
    return list(read_metrics(run / "metrics.jsonl"))


def _losses(records: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}  # a step logged twice: the later wins


def test_rewind_restores_the_checkpoint_skips_the_window_and_equals_a_resume_that_skips_it(tmp_path: Path) -> None:
    run = tmp_path / "rewind"
    outcome = run_training(_settings(run, "--resilience.spike_policy=rewind"), hooks=[ScaleLROnce(SPIKE - 1)])
    assert outcome.status == "completed" and outcome.step == 40
    records = _records(run)
    spikes = [r for r in records if "spike/step" in r]
    assert len(spikes) == 1, spikes
    assert spikes[0]["spike/step"] == SPIKE and spikes[0]["spike/rewound_to"] == 20
    assert spikes[0]["spike/skipped_steps"] == SPIKE - 20 and spikes[0]["spike/rewinds"] == 1
    assert spikes[0]["spike/loss"] > spikes[0]["spike/threshold"]
    first = {}
    for r in records:
        if "loss" in r:
            first.setdefault(r["step"], r["loss"])
    assert first[SPIKE] == spikes[0]["spike/loss"]
    losses = _losses(records)
    assert sorted(losses) == list(range(1, 41))
    assert losses[21] != first[21]  # after the rewind, step 21 trains on the batch of step 26
    state = json.loads((run / "checkpoints" / "step_40" / "train_state.json").read_text())
    assert state["progress"]["data_skips"] == [
        {"spike_step": SPIKE, "detected_at": SPIKE, "rewound_to": 20, "skipped_steps": SPIKE - 20}
    ]
    assert state["parts"]["loss_spike"]["rewinds"] == 1

    # A fresh process resumed from the same checkpoint skips the same window (the rewind's record
    # next to the checkpoints says so), and trains bit-for-bit like the rewound run from there on.
    ref = tmp_path / "resumed"
    (ref / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step_20", ref / "checkpoints" / "step_20")
    (ref / "checkpoints" / "latest").write_text("step_20\n")
    shutil.copy(run / "checkpoints" / "data_skips.json", ref / "checkpoints" / "data_skips.json")
    (ref / "config.toml").write_text((run / "config.toml").read_text())
    outcome = run_training(_settings(ref, "--resilience.spike_policy=rewind"))
    assert outcome.status == "completed"
    resumed = _losses(_records(ref))
    assert sorted(resumed) == list(range(21, 41))
    assert {k: losses[k] for k in range(21, 41)} == resumed  # bit-exact


def test_warn_only_reports(tmp_path: Path) -> None:
    run = tmp_path / "warn"
    outcome = run_training(_settings(run, "--resilience.spike_policy=warn"), hooks=[ScaleLROnce(SPIKE - 1)])
    assert outcome.status == "completed"
    records = _records(run)
    spikes = [r for r in records if "spike/step" in r]
    assert spikes and spikes[0]["spike/step"] == SPIKE and all("spike/rewound_to" not in r for r in spikes)
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 41))  # nothing trained twice
    assert not (run / "checkpoints" / "data_skips.json").exists()


def test_off_and_a_clean_run_record_nothing(tmp_path: Path) -> None:
    run_training(_settings(tmp_path / "clean", "--resilience.spike_policy=rewind"))
    assert not [r for r in _records(tmp_path / "clean") if "spike/step" in r]


def test_the_guard_ignores_noise_and_non_finite_losses_and_survives_a_checkpoint() -> None:
    guard = SpikeGuard("warn", window=8, sigma=6.0, ratio=1.2, max_rewinds=1)
    for step, loss in enumerate([3.0, 3.1, 2.9, 3.05, float("nan"), 2.95, 3.0, 3.1, 2.9], start=1):
        guard.observe(step, torch.tensor(loss))
    assert guard.settle() is None  # full window only after the 9th value (the NaN is not history)
    guard.observe(10, torch.tensor(3.3))  # within 1.2 x mean
    assert guard.settle() is None
    guard.observe(11, torch.tensor(9.0))
    guard.observe(12, torch.tensor(8.0))
    event = guard.settle()
    assert event is not None and event.step == 11 and event.count == 2 and event.loss == 9.0
    restored = SpikeGuard("warn", window=8, sigma=6.0, ratio=1.2, max_rewinds=1)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    for g in (guard, restored):
        g.observe(13, torch.tensor(7.5))  # the spikes stayed out of the history: still a spike
    a, b = guard.settle(), restored.settle()
    assert a is not None and b is not None and a == b
