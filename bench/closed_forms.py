"""Benchmark: does each eager CPU closed form (engine/model/eager_cpu.py) speed up `kforge train`?

The default job (`kforge train`, no flags: the cpu-debug profile, fp32 eager CPU) runs in
four variants: as shipped, without the RMSNorm closed form, without the RoPE closed form,
and without both. "Without" swaps in the plain layer the closed form replaces (torch's
``F.rms_norm``; ``x * cos + rotate_half(x) * sin``), which is what compile, DTensor and CUDA
run; the switch lives here only (a patch applied in the child process before training).
Each run is a fresh process that trains the whole default job through ``run_training``
(evaluation, checkpoints and logging as configured), and its figures are taken after
``--warmup`` steps: tokens per wall second over the rest of the run (evaluation included),
tokens per CPU second of the process (less disturbed by other load), and tokens per second
of the median step. Variants alternate run by run (rotating which goes first), so machine
load drifts over all of them alike. The speed-up of a closed form is as-shipped over
without-it: of the medians over runs, and the median of the per-round ratios (paired). Issue 27's rule: a closed form stays only with >= 1.05.
Prints a table, writes bench/results/closed_forms.json.

    python bench/closed_forms.py [--runs 5] [--warmup 10] [--lock FILE] [overrides...]
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("shipped", "no-rmsnorm", "no-rope", "neither")
TARGET = 1.05


def _patch(variant: str) -> None:
    """Replace the closed forms `variant` turns off with the plain layers (this process only)."""
    import torch
    import torch.nn.functional as F

    from kforge_cli.engine.model import attention, layers

    if variant in ("no-rmsnorm", "neither"):

        def plain_rms(self: layers.RMSNorm, x: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).to(x.dtype)

        layers.RMSNorm.forward = plain_rms  # type: ignore[method-assign]
    if variant in ("no-rope", "neither"):

        def plain_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            return (xf * cos.unsqueeze(-2) + layers.rotate_half(xf) * sin.unsqueeze(-2)).to(x.dtype)

        def plain_pair(
            q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return plain_rotate(q, cos, sin), plain_rotate(k, cos, sin)

        attention.apply_rotary_pair = plain_pair  # type: ignore[assignment]


def child(variant: str, warmup: int, overrides: list[str]) -> None:
    """One default training run under `variant`; prints its figures as one JSON line."""
    _patch(variant)
    import torch

    from kforge_cli.engine.train import StepInfo, TrainHook, run_training
    from kforge_cli.settings import load_settings

    class Clock(TrainHook):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []

        def on_step_end(self, session: object, info: StepInfo) -> None:
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    settings = load_settings(overrides=overrides).settings
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        settings.train.run_dir = tmp
        run_training(settings, hooks=[clock])
    t = settings.train
    tokens = t.batch_size * t.seq_len * t.grad_accum_steps
    wall, cpu = clock.wall[warmup:], clock.cpu[warmup:]
    steps = len(wall) - 1
    step_times = [b - a for a, b in itertools.pairwise(wall)]
    print(
        json.dumps(
            {
                "variant": variant,
                "threads": torch.get_num_threads(),
                "steps": steps,
                "wall_tokens_per_sec": tokens * steps / (wall[-1] - wall[0]),
                "cpu_tokens_per_sec": tokens * steps / (cpu[-1] - cpu[0]),
                "median_step_tokens_per_sec": tokens / statistics.median(step_times),
            }
        )
    )


def run_once(variant: str, warmup: int, overrides: list[str], lock: str | None) -> dict[str, float]:
    """One child run; with `lock`, holding an exclusive flock on that file while it runs (a shared
    machine's benchmark lock: other jobs that take it cannot run alongside, and can run between runs)."""
    cmd = [sys.executable, __file__, "--child", variant, "--warmup", str(warmup), *overrides]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    with open(lock or os.devnull, "a") as held:
        if lock:
            fcntl.flock(held, fcntl.LOCK_EX)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--child", choices=VARIANTS)
    ap.add_argument("--lock", help="flock this file around each run (see run_once)")
    ap.add_argument("--out", default=str(HERE / "results" / "closed_forms.json"))
    args, overrides = ap.parse_known_args()
    overrides = ["--metrics.progress_bar=off", *overrides]
    if args.child:
        child(args.child, args.warmup, overrides)
        return
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for i in range(args.runs):
        order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
        for variant in order:
            r = run_once(variant, args.warmup, overrides, args.lock)
            runs[variant].append(r)
            print(f"run {i + 1}/{args.runs} {variant:<11} {r['wall_tokens_per_sec']:>9,.0f} tok/s ({r['threads']} thr)")
    metrics = ("wall_tokens_per_sec", "cpu_tokens_per_sec", "median_step_tokens_per_sec")
    med = {v: {m: statistics.median(r[m] for r in runs[v]) for m in metrics} for v in VARIANTS}
    print(f"\n{'variant':<12}" + "".join(f"{m.removesuffix('_tokens_per_sec') + ' tok/s':>20}" for m in metrics))
    for v in VARIANTS:
        print(f"{v:<12}" + "".join(f"{med[v][m]:>20,.0f}" for m in metrics))
    speedups: dict[str, dict[str, float]] = {}
    for form, without in (("rmsnorm", "no-rmsnorm"), ("rope", "no-rope"), ("both", "neither")):
        speedups[form] = {m: med["shipped"][m] / med[without][m] for m in metrics}
        paired = [
            a["wall_tokens_per_sec"] / b["wall_tokens_per_sec"]
            for a, b in zip(runs["shipped"], runs[without], strict=True)
        ]
        speedups[form]["paired_wall_median"] = statistics.median(paired)
        speedups[form]["paired_wall_min"] = min(paired)
        speedups[form]["paired_wall_max"] = max(paired)
        cells = "".join(f"{speedups[form][m]:>20.3f}" for m in metrics)
        verdict = "keeps" if speedups[form]["wall_tokens_per_sec"] >= TARGET else "below"
        sp = speedups[form]
        print(f"{form + ' x':<12}{cells}   ({verdict} the {TARGET:.2f}x bar, wall)")
        print(
            f"{'':<12}paired per round (wall): median {sp['paired_wall_median']:.3f}, "
            f"range {sp['paired_wall_min']:.3f}-{sp['paired_wall_max']:.3f}"
        )
    result = {
        "job": "kforge train (default: cpu-debug profile)",
        "overrides": overrides,
        "runs": args.runs,
        "warmup": args.warmup,
        "cpus": os.cpu_count(),
        "threads": sorted({r["threads"] for rs in runs.values() for r in rs}),
        "median": med,
        "speedup_with_closed_form": speedups,
        "target": TARGET,
        "raw": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
