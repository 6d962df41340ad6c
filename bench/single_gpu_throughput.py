"""Benchmark (gpu): tokens/s and MFU of a ~1B model on one GPU, bf16 vs float8, eager vs compiled.

Each variant is a real `run_training` (kforge's whole loop on the built-in corpus) of
`--steps` steps; the first `--warmup` steps (compilation, allocator warm-up) are
excluded from the throughput. MFU counts 6 x non-embedding params + attention FLOPs per
token against the GPU's dense bf16 peak (for float8 too, so the columns compare
directly; float8's own peak is about 2x higher). Prints a table and writes
bench/results/single_gpu_throughput.json.

    python bench/single_gpu_throughput.py [--steps 40] [--warmup 15] [--variants bf16,bf16+compile,...]

Needs CUDA and torchao (float8); it refuses to run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kforge_cli.engine.model import flops_per_token
from kforge_cli.engine.observe import device_peak_flops
from kforge_cli.engine.train import StepInfo, TrainHook, run_training
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent

# ~1.0B parameters (18 blocks of dim 2048, GQA 16/8 heads, SwiGLU 5504, vocab 32768).
MODEL = [
    "--model.dim=2048",
    "--model.n_layers=18",
    "--model.n_heads=16",
    "--model.n_kv_heads=8",
    "--model.vocab_size=32768",
    "--model.max_seq_len=2048",
]
TRAIN = [
    "--train.seq_len=2048",
    "--train.batch_size=4",
    "--train.device=cuda",
    "--train.mixed_precision=bf16",
    "--eval.interval=0",
    "--checkpoint.save_final=false",
    "--checkpoint.interval=0",
    "--metrics.progress_bar=off",
    "--scheduler.warmup_steps=5",
]
VARIANTS = {
    "bf16": [],
    "bf16+compile": ["--train.compile_model=true"],
    "float8+compile": ["--train.compile_model=true", "--train.float8=true"],
    "float8-rowwise+compile": ["--train.compile_model=true", "--train.float8=true", "--train.float8_recipe=rowwise"],
}


class StepClock(TrainHook):
    """Wall time at the end of every optimizer step (synchronised with the GPU) and the losses."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []

    def on_train_begin(self, session: object) -> None:
        torch.cuda.synchronize()
        self.times = [time.perf_counter()]

    def on_step_end(self, session: object, info: StepInfo) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        self.losses.append(info.loss)


def run_variant(name: str, steps: int, warmup: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(
            overrides=[*MODEL, *TRAIN, *VARIANTS[name], f"--train.max_steps={steps}", f"--train.run_dir={tmp}"]
        ).settings
        clock = StepClock()
        torch.cuda.reset_peak_memory_stats()
        run_training(settings, hooks=[clock])
    t = settings.train
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum_steps
    step_times = [b - a for a, b in zip(clock.times[warmup:], clock.times[warmup + 1 :], strict=False)]
    step_s = statistics.median(step_times)
    tps = tokens_per_step / step_s
    peak = device_peak_flops(torch.device("cuda"), "bf16", None)
    fpt = flops_per_token(settings.model, t.seq_len)
    return {
        "variant": name,
        "tokens_per_sec": tps,
        "median_step_s": step_s,
        "mfu_vs_bf16_peak": (fpt * tps / peak) if peak else None,
        "warmup_s": clock.times[warmup] - clock.times[0],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": clock.losses[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS)
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("single_gpu_throughput needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [run_variant(v, args.steps, args.warmup) for v in args.variants.split(",")]
    base = rows[0]["tokens_per_sec"]
    print(f"{torch.cuda.get_device_name()}  ~1B model, seq 2048, batch 4, {args.steps} steps ({args.warmup} warm-up)")
    print(f"{'variant':<24}{'tokens/s':>12}{'x base':>8}{'MFU(bf16)':>11}{'warm-up s':>11}{'peak GiB':>10}{'loss':>8}")
    for r in rows:
        mfu = f"{r['mfu_vs_bf16_peak']:.1%}" if r["mfu_vs_bf16_peak"] is not None else "n/a"
        print(
            f"{r['variant']:<24}{r['tokens_per_sec']:>12,.0f}{r['tokens_per_sec'] / base:>8.2f}{mfu:>11}"  # type: ignore[operator]
            f"{r['warmup_s']:>11.1f}{r['peak_mem_gib']:>10.1f}{r['final_loss']:>8.3f}"
        )
    out = HERE / "results" / "single_gpu_throughput.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "steps": args.steps, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
