"""Benchmark: does each eager CPU closed form (engine/model/eager_cpu.py) speed up `kforge train`?

The default job (`kforge train`, no flags: the cpu-debug profile, fp32 eager CPU) trains
with the closed forms switched on and off in four variants: as shipped, without the RMSNorm
closed form, without the RoPE closed form, and without both. "Without" swaps in the plain
layer the closed form replaces (torch's ``F.rms_norm``; ``x * cos + rotate_half(x) * sin``),
which is what compile, DTensor and CUDA run; the switch lives here only (the bench rebinds
``RMSNorm.forward`` and attention's ``apply_rotary_pair`` in its own child process).

Why the variants alternate *within* a run: on a shared 2-core machine the speed of whole
runs drifts by 20% or more with other load (and the thread count kforge picks follows that
load), far more than the effect measured. So each run is the whole default job in a fresh
process, and the variant changes every ``--block`` optimizer steps, cycling through all
four (the cycle's start rotates from run to run); every variant sees the same load. A
variant's figure is tokens per second of its median step (steps that evaluate or save a
checkpoint, and the ``--warmup`` first ones, are left out), per run; the speed-up of
a closed form is as-shipped over without-it per run, and its median over ``--runs`` runs.
Issue 27's rule: a closed form stays only at >= 1.05. Prints a table, writes
bench/results/closed_forms.json.

    python bench/closed_forms.py [--runs 5] [--block 5] [--warmup 10] [--lock FILE] [overrides...]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("shipped", "no-rmsnorm", "no-rope", "neither")
TARGET = 1.05


def _switches() -> Callable[[str], None]:
    """A function that puts the layers into one variant (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from kforge_cli.engine.model import attention, layers

    shipped_rms, shipped_pair = layers.RMSNorm.forward, attention.apply_rotary_pair

    def plain_rms(self: layers.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).to(x.dtype)

    def plain_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * cos.unsqueeze(-2) + layers.rotate_half(xf) * sin.unsqueeze(-2)).to(x.dtype)

    def plain_pair(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return plain_rotate(q, cos, sin), plain_rotate(k, cos, sin)

    def switch(variant: str) -> None:
        layers.RMSNorm.forward = plain_rms if variant in ("no-rmsnorm", "neither") else shipped_rms  # type: ignore[method-assign]
        attention.apply_rotary_pair = plain_pair if variant in ("no-rope", "neither") else shipped_pair  # type: ignore[assignment]

    return switch


def child(first: int, block: int, warmup: int, overrides: list[str]) -> None:
    """The default training run, switching variants every `block` steps; prints one JSON line."""
    import torch

    from kforge_cli.engine.train import StepInfo, TrainHook, run_training
    from kforge_cli.settings import load_settings

    switch = _switches()
    settings = load_settings(overrides=overrides).settings
    t = settings.train
    tokens = t.batch_size * t.seq_len * t.grad_accum_steps
    # Steps that evaluate or save, and the step after (whichever side of the hook that work falls on).
    intervals = [i for i in (settings.eval.interval, settings.checkpoint.interval) if i]
    busy = {s + d for s in range(1, t.max_steps + 1) for i in intervals if s % i == 0 for d in (0, 1)}

    class Alternate(TrainHook):
        def __init__(self) -> None:
            self.steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
            self.current = VARIANTS[first]
            self.step = 0
            self.last = 0.0

        def on_train_begin(self, session: object) -> None:
            switch(self.current)
            self.last = time.perf_counter()

        def on_step_end(self, session: object, info: StepInfo) -> None:
            now = time.perf_counter()
            self.step += 1
            if self.step > warmup and self.step not in busy:
                self.steps[self.current].append(now - self.last)
            if self.step % block == 0:
                self.current = VARIANTS[(first + self.step // block) % len(VARIANTS)]
                switch(self.current)
            self.last = time.perf_counter()

    clock = Alternate()
    with tempfile.TemporaryDirectory() as tmp:
        settings.train.run_dir = tmp
        run_training(settings, hooks=[clock])
    result = {
        "threads": torch.get_num_threads(),
        "steps": {v: len(s) for v, s in clock.steps.items()},
        "tokens_per_sec": {v: tokens / statistics.median(s) for v, s in clock.steps.items()},
    }
    print(json.dumps(result))


def run_once(first: int, args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """One child run; with ``--lock``, holding an exclusive flock on that file while it runs (a
    shared machine's benchmark lock: jobs that take it cannot run alongside, only between runs)."""
    cmd = [sys.executable, __file__, "--child", str(first), "--block", str(args.block), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    with open(args.lock or os.devnull, "a") as held:
        if args.lock:
            fcntl.flock(held, fcntl.LOCK_EX)
        done = subprocess.run([*cmd, *overrides], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--block", type=int, default=5, help="optimizer steps per variant before the next one")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lock", help="flock this file around each run (see run_once)")
    ap.add_argument("--out", default=str(HERE / "results" / "closed_forms.json"))
    args, overrides = ap.parse_known_args()
    overrides = ["--metrics.progress_bar=off", *overrides]
    if args.child is not None:
        child(args.child, args.block, args.warmup, overrides)
        return
    runs = []
    print(f"{'run':<5}{'threads':>8}" + "".join(f"{v + ' tok/s':>18}" for v in VARIANTS))
    for i in range(args.runs):
        r = run_once(i % len(VARIANTS), args, overrides)
        runs.append(r)
        print(f"{i + 1:<5}{r['threads']:>8}" + "".join(f"{r['tokens_per_sec'][v]:>18,.0f}" for v in VARIANTS))
    median = {v: statistics.median(r["tokens_per_sec"][v] for r in runs) for v in VARIANTS}
    print(f"{'median':<13}" + "".join(f"{median[v]:>18,.0f}" for v in VARIANTS))
    speedups = {}
    print(f"\n{'closed form':<13}{'with tok/s':>12}{'without':>12}{'speed-up (median of runs)':>28}{'range':>16}")
    for form, without in (("rmsnorm", "no-rmsnorm"), ("rope", "no-rope"), ("both", "neither")):
        ratios = [r["tokens_per_sec"]["shipped"] / r["tokens_per_sec"][without] for r in runs]
        speedups[form] = {"median": statistics.median(ratios), "runs": ratios}
        verdict = "meets" if speedups[form]["median"] >= TARGET else "below"
        span = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(
            f"{form:<13}{median['shipped']:>12,.0f}{median[without]:>12,.0f}"
            f"{speedups[form]['median']:>22.3f} ({verdict}){span:>16}"
        )
    result = {
        "job": "kforge train (default: cpu-debug profile)",
        "overrides": overrides,
        "runs": args.runs,
        "block": args.block,
        "warmup": args.warmup,
        "cpus": os.cpu_count(),
        "median_tokens_per_sec": median,
        "speedup_with_closed_form": speedups,
        "target": TARGET,
        "raw": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
