"""MoE through the real loop: load metrics in metrics.jsonl, aux losses train, resume is bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.observe import read_metrics
from kforge_cli.engine.train import TrainHook, run_training
from kforge_cli.settings import load_settings
from tests.helpers import tiny

TINY = [
    *tiny.model(32, 2, 4, vocab_size=320, max_seq_len=32),
    *tiny.moe(),
    "--train.seq_len=16",
    "--train.batch_size=4",
    *tiny.CPU_FP32,
    "--scheduler.name=constant",
    "--scheduler.warmup_steps=0",
    *tiny.QUIET,
    "--metrics.log_interval=2",
    "--checkpoint.interval=3",
]


class Record(TrainHook):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.bias: dict[str, torch.Tensor] = {}

    def on_step_end(self, session: Any, info: Any) -> None:
        self.losses[info.step] = info.loss

    def on_train_end(self, session: Any, status: str) -> None:
        self.bias = {n: b.clone() for n, b in session.model.named_buffers() if n.endswith("expert_bias")}


def _run(run_dir: Path, steps: int) -> Record:
    rec = Record()
    s = load_settings(overrides=[*TINY, f"--train.run_dir={run_dir}", f"--train.max_steps={steps}"], use_env=False)
    assert run_training(s.settings, hooks=[rec]).status == "completed"
    return rec


def test_moe_run_logs_expert_load_and_resumes_bit_exact(tmp_path: Path) -> None:
    straight = _run(tmp_path / "a", 6)
    records = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert {2, 4, 6} <= {r["step"] for r in records}
    for r in records:
        for layer in ("0", "1"):
            assert r[f"moe/{layer}/load_max_over_mean"] >= 1.0 and r[f"moe/{layer}/dropped"] == 0.0
            assert r[f"moe/{layer}/aux_loss"] > 0
    assert len(straight.bias) == 2 and all(b.abs().sum() > 0 for b in straight.bias.values())

    _run(tmp_path / "b", 3)  # stops after the step-3 checkpoint ...
    resumed = _run(tmp_path / "b", 6)  # ... and continues from it
    assert sorted(resumed.losses) == [4, 5, 6]
    assert all(resumed.losses[k] == straight.losses[k] for k in (4, 5, 6))  # bit-exact
    for name, bias in straight.bias.items():
        assert torch.equal(resumed.bias[name], bias), name
