"""Benchmark: kforge's training throughput vs a minimal hand-written PyTorch loop.

Both train the identical architecture (kforge's Transformer) on the same batch shape
with the same optimizer settings, in the same process and threads, alternating
kforge / hand-written runs; the median tokens/s of each over several runs gives the
ratio (by wall clock, and by this process's CPU time, which a busy machine disturbs
less). kforge's figure covers its whole loop (data loading, loss normalisation, NaN
policy, scheduler, logging); only the first `warmup` steps of every run are excluded.
Target: ratio >= 0.97 (overhead under 3%). Prints a table, writes
bench/results/train_overhead.json.

    python bench/train_overhead.py [--runs 5] [--steps 60] [--warmup 10] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.train import StepInfo, TrainHook, run_training
from kforge_cli.engine.train.optim.optimizer import build_optimizer
from kforge_cli.settings import JobSettings, load_settings

HERE = Path(__file__).resolve().parent


class StepClock(TrainHook):
    """Records the wall time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []

    def on_train_begin(self, session: object) -> None:
        self.times, self.cpu = [time.perf_counter()], [time.process_time()]

    def on_step_end(self, session: object, info: StepInfo) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())


def tokens_per_sec(times: list[float], warmup: int, tokens_per_step: int) -> float:
    steady = times[warmup:]
    return tokens_per_step * (len(steady) - 1) / (steady[-1] - steady[0])


def kforge_run(settings: JobSettings, warmup: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process)."""
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        s = settings.model_copy(deep=True)
        s.train.run_dir = tmp
        run_training(s, hooks=[clock])
    t = s.train
    n = t.batch_size * t.seq_len * t.grad_accum_steps
    return tokens_per_sec(clock.times, warmup, n), tokens_per_sec(clock.cpu, warmup, n)


def hand_run(settings: JobSettings, steps: int, warmup: int) -> tuple[float, float]:
    """The minimal loop a researcher would write: forward, CE, backward, clip, AdamW, zero_grad."""
    t = settings.train
    torch.manual_seed(t.seed)
    model = Transformer(settings.model)
    model.train()
    opt = build_optimizer(model, settings)  # same param groups and fused/foreach choice as kforge
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 257, (steps, t.batch_size, t.seq_len + 1), generator=g)
    clip = t.grad_clip_norm or math.inf
    times, cpu = [time.perf_counter()], [time.process_time()]
    for i in range(steps):
        x, y = data[i, :, :-1], data[i, :, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter())
        cpu.append(time.process_time())
    n = t.batch_size * t.seq_len
    return tokens_per_sec(times, warmup, n), tokens_per_sec(cpu, warmup, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile", default="cpu-debug")
    args, overrides = ap.parse_known_args()
    fixed = [
        f"--train.max_steps={args.steps}",
        "--eval.interval=0",
        "--checkpoint.interval=0",
        "--metrics.progress_bar=off",
        "--scheduler.warmup_steps=1",
    ]
    settings = load_settings(args.profile, overrides=fixed + overrides).settings
    kf, hand = [], []
    for _ in range(args.runs):
        kf.append(kforge_run(settings, args.warmup))
        hand.append(hand_run(settings, args.steps, args.warmup))
    result: dict[str, object] = {
        "profile": args.profile,
        "threads": torch.get_num_threads(),
        "runs": args.runs,
        "steps": args.steps,
    }
    print(f"{'loop':<14}{'clock':<6}{'median tok/s':>14}{'min':>12}{'max':>12}")
    for i, clock in enumerate(("wall", "cpu")):
        k, h = [r[i] for r in kf], [r[i] for r in hand]
        for name, xs in (("kforge", k), ("hand-written", h)):
            print(f"{name:<14}{clock:<6}{statistics.median(xs):>14,.0f}{min(xs):>12,.0f}{max(xs):>12,.0f}")
        ratio = statistics.median(k) / statistics.median(h)
        result[f"{clock}_kforge_tokens_per_sec"] = statistics.median(k)
        result[f"{clock}_hand_tokens_per_sec"] = statistics.median(h)
        result[f"{clock}_ratio"] = ratio
        result[f"{clock}_runs"] = {"kforge": k, "hand": h}
        print(f"ratio kforge/hand ({clock} clock) = {ratio:.3f}  (target >= 0.97)")
    out = HERE / "results" / "train_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
