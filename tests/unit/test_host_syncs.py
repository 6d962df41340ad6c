"""Host reads of device values per optimizer step (each one a GPU sync): none on an ordinary step.

Counted on CPU by patching every `Tensor` method that hands a value to the host
(tests.helpers.host_reads); on a GPU, `torch.cuda.set_sync_debug_mode("error")` makes any
sync during steady-state steps raise. Before this change a plain step read 5 values
(per-micro-batch label count, loss sum, token count twice, gradient norm), plus the
stop-flag all-reduce on several processes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kforge_cli.engine.train import TrainHook, run_training
from tests.helpers.host_reads import READS, HostReads, ReadsPerStep
from tests.helpers.tiny_run import tiny_settings

LOG_EVERY = 5
RUN = [
    "--model.vocab_size=320",  # the built-in corpus is byte-tokenized (257 ids)
    "--train.batch_size=2",
    "--train.grad_accum_steps=2",
    "--train.max_steps=11",
    f"--metrics.log_interval={LOG_EVERY}",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
    "--metrics.progress_bar=off",
    "--train.num_threads=1",
]


def reads_per_step(tmp_path: Path, *extra: str) -> dict[int, int]:
    reads = HostReads()
    hook = ReadsPerStep(reads)
    with reads.counting():
        run_training(tiny_settings(*RUN, f"--train.run_dir={tmp_path / 'run'}", *extra), hooks=[hook])
    return hook.per_step()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--optimizer.fused=true"], 0),  # the NaN policy skips through the fused kernel's found_inf
        (["--resilience.nan_policy=warn"], 0),  # nothing to decide before the update
        ([], 1),  # skip policy with foreach AdamW: the loss and norm are read once (documented)
    ],
    ids=["fused-adamw", "warn", "foreach-adamw-skip"],
)
def test_ordinary_steps_read_nothing_and_logging_steps_read_once(
    tmp_path: Path, extra: list[str], expected: int
) -> None:
    per_step = reads_per_step(tmp_path, *extra)
    steady = {s: n for s, n in per_step.items() if s % LOG_EVERY and s != 11}
    logged = {s: n for s, n in per_step.items() if s not in steady}
    print(f"host reads per step {extra}: {per_step}")
    assert set(steady.values()) == {expected}, per_step
    assert all(n <= expected + 2 for n in logged.values()), per_step  # the step's numbers + the NaN tallies


class _NoSyncBetween(TrainHook):
    """Turns CUDA's sync detector to "error" after step `start` and off after step `stop`."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop, self.checked = start, stop, 0

    def on_step_end(self, session: Any, info: Any) -> None:
        if info.step == self.start:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        elif info.step == self.stop:
            torch.cuda.set_sync_debug_mode("default")
            self.checked = self.stop - self.start


@pytest.mark.gpu
def test_steady_state_steps_do_not_sync_on_cuda(tmp_path: Path) -> None:
    hook = _NoSyncBetween(2, 4)
    settings = tiny_settings(
        *RUN,
        f"--train.run_dir={tmp_path / 'run'}",
        "--train.device=cuda",
        "--train.mixed_precision=bf16",
        "--metrics.log_interval=100",
        "--train.max_steps=6",
    )
    try:
        run_training(settings, hooks=[hook])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hook.checked == 2


class _FakeDevice:
    """A device that runs `per_step` seconds behind the host: every optimizer update queues that much
    work, and it is waited for only at a device sync or when the host reads a value (as on a GPU)."""

    def __init__(self, per_step: float) -> None:
        self.per_step, self.pending, self.updates = per_step, 0.0, 0
        self.waits_at: list[int] = []  # the update count at each explicit device sync

    def queue(self) -> None:
        self.updates += 1
        self.pending += self.per_step

    def drain(self) -> None:
        if self.pending:
            time.sleep(self.pending)
            self.pending = 0.0

    def sync(self, _device: torch.device) -> None:
        self.waits_at.append(self.updates)
        self.drain()


def test_logged_throughput_waits_for_the_device_on_log_steps_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokens_per_sec and step_time_s include the device's pending work: the step clock stops at a
    device sync on logging steps (and only there), not when the host has merely queued the work."""
    from kforge_cli.engine.observe import read_metrics
    from kforge_cli.engine.train import loop

    fake = _FakeDevice(per_step=0.5)
    update = loop.apply_update
    monkeypatch.setattr(loop, "apply_update", lambda *a, **k: (update(*a, **k), fake.queue())[0])
    monkeypatch.setattr(loop, "device_wait", fake.sync, raising=False)
    for name in READS:  # a host read waits for the device, like a real GPU's
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _f=original, **k: (fake.drain(), _f(t, *a, **k))[1])
    run = tmp_path / "run"
    overrides = [*RUN, "--train.max_steps=6", "--metrics.log_interval=3", "--resilience.nan_policy=warn"]
    run_training(tiny_settings(*overrides, f"--train.run_dir={run}"))
    logged = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "tokens_per_sec" in r}
    assert sorted(logged) == [1, 3, 6]
    tokens_per_step = logged[1]["tokens_seen"]  # after step 1
    for step, rec in logged.items():
        assert rec["step_time_s"] >= 0.5, (step, rec)  # every step's 0.5 s of device work is in the clock
        assert rec["tokens_per_sec"] <= tokens_per_step / 0.5, (step, rec)
    assert fake.waits_at == [1, 3, 6]  # one sync per logging step, none on steps 2, 4, 5
