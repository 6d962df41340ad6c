"""Benchmark: MoE load balancing and CPU throughput on the moe-debug profile.

1. Balancing: moe-debug trained ``--steps`` steps (default 200) with aux-loss-free
   bias balancing (``model.moe.bias_update_rate``, default 1e-3) and without it (0), same
   seed and data. Reported: max/mean tokens per expert (``moe/load_max_over_mean``,
   averaged over MoE layers) at the last step and averaged over the last 20 steps.
   Lower is better balanced; 1.0 is perfect.
2. Throughput: moe-debug vs a dense model with the same *active* parameters per token
   (cpu-debug shape, 4 layers, MLP hidden 384 ~ the MoE block's router + shared + top-2
   experts), alternating runs, median tokens/s of the steady steps; the ratio MoE/dense.

Prints a table, writes bench/results/moe_balance.json.

    python bench/moe_balance.py [--steps 200] [--runs 2] [--tp-steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.train import StepInfo, TrainHook, run_training
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent
COMMON = ["--train.num_threads=1", "--eval.interval=0", "--checkpoint.interval=0", "--checkpoint.save_final=false"]
COMMON += ["--metrics.progress_bar=off", "--metrics.log_interval=1000"]


class Watch(TrainHook):
    """Per-step MoE load ratio and wall times."""

    def __init__(self) -> None:
        self.load: list[float] = []
        self.times: list[float] = []

    def on_train_begin(self, session: Any) -> None:
        self.times = [time.perf_counter()]

    def on_step_end(self, session: Any, info: StepInfo) -> None:
        self.times.append(time.perf_counter())
        if "moe/load_max_over_mean" in info.extra:
            self.load.append(info.extra["moe/load_max_over_mean"])


def run(profile: str, overrides: list[str]) -> Watch:
    watch = Watch()
    with tempfile.TemporaryDirectory() as tmp:
        s = load_settings(profile, overrides=[*COMMON, *overrides, f"--train.run_dir={tmp}/run"], use_env=False)
        run_training(s.settings, hooks=[watch])
    return watch


def tokens_per_sec(w: Watch, tokens_per_step: int, warmup: int = 5) -> float:
    t = w.times[warmup:]
    return tokens_per_step * (len(t) - 1) / (t[-1] - t[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1e-3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tp-steps", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="a few steps, one run, no results file (checks the script)")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.runs, args.tp_steps = 2, 1, 8
        COMMON.extend(["--train.seq_len=32", "--train.batch_size=2"])
    torch.set_num_threads(1)
    steps = [f"--train.max_steps={args.steps}"]
    balance = {}
    for name, rate in (("with bias balancing", args.rate), ("without", 0.0)):
        w = run("moe-debug", [*steps, f"--model.moe.bias_update_rate={rate}"])
        balance[name] = {"rate": rate, "last": w.load[-1], "mean_last_20": statistics.mean(w.load[-20:])}
    tp_steps = [f"--train.max_steps={args.tp_steps}", "--scheduler.warmup_steps=5"]
    dense = ["--model.ffn_hidden_dim=384", "--model.n_layers=4", "--train.batch_size=8"]
    s_moe = load_settings("moe-debug", use_env=False).settings
    s_dense = load_settings("cpu-debug", overrides=dense, use_env=False).settings
    tokens = s_moe.train.batch_size * s_moe.train.seq_len
    speeds: dict[str, list[float]] = {"moe": [], "dense": []}
    for _ in range(args.runs):
        speeds["moe"].append(tokens_per_sec(run("moe-debug", tp_steps), tokens))
        speeds["dense"].append(tokens_per_sec(run("cpu-debug", [*tp_steps, *dense]), tokens))
    moe_tps, dense_tps = statistics.median(speeds["moe"]), statistics.median(speeds["dense"])
    result = {
        "steps": args.steps,
        "balance": balance,
        "throughput": {
            "moe_tokens_per_s": moe_tps,
            "dense_tokens_per_s": dense_tps,
            "ratio_moe_over_dense": moe_tps / dense_tps,
            "moe_active_params": s_moe.model.param_count(active=True),
            "moe_total_params": s_moe.model.param_count(),
            "dense_params": s_dense.model.param_count(),
            "runs": speeds,
        },
    }
    print(f"max/mean tokens per expert after {args.steps} steps (moe-debug, mean over MoE layers)")
    print(f"  {'':<22}{'last step':>10}{'last 20':>10}")
    for name, b in balance.items():
        print(f"  {name:<22}{b['last']:>10.3f}{b['mean_last_20']:>10.3f}")
    t = result["throughput"]
    print("CPU throughput (1 thread)")
    print(
        f"  moe-debug {moe_tps:,.0f} tok/s ({t['moe_active_params'] / 1e6:.2f}M active of {t['moe_total_params'] / 1e6:.2f}M)"
    )
    print(f"  dense     {dense_tps:,.0f} tok/s ({t['dense_params'] / 1e6:.2f}M)")
    print(f"  ratio moe/dense {t['ratio_moe_over_dense']:.2f}")
    if args.smoke:  # checks the script; its figures mean nothing
        return
    out = HERE / "results" / "moe_balance.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
