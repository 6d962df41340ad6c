"""Benchmark: CPU generation speed of the cpu-debug model, KV cache vs full recomputation.

Greedy decoding of ``--new`` tokens after a ``--prompt``-token prompt, one thread, fp32,
median of ``--repeat`` runs per mode, both modes side by side in one process (the
weights are a fresh init: speed does not depend on them). Prints a table and writes
bench/results/generate_speed.json.

    python bench/generate_speed.py [--prompt 64] [--new 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model.generation import generate_tokens
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent


def _run(model: Transformer, prompt: list[int], new: int, cache: bool) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = list(generate_tokens(model, prompt, max_new_tokens=new, use_cache=cache))
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=256, help="new tokens per run")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = load_settings(profile="cpu-debug", use_env=False).settings
    torch.manual_seed(0)
    model = Transformer(settings.model).eval()
    prompt = torch.randint(0, 256, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    rows: dict[str, dict[str, float]] = {}
    outputs: dict[str, list[int]] = {}
    for mode in ("cached", "recompute"):
        _run(model, prompt, 8, mode == "cached")  # warm-up
        times = []
        for _ in range(args.repeat):
            seconds, outputs[mode] = _run(model, prompt, args.new, mode == "cached")
            times.append(seconds)
        median = statistics.median(times)
        rows[mode] = {"seconds": median, "tokens_per_sec": len(outputs[mode]) / median}
    speedup = rows["cached"]["tokens_per_sec"] / rows["recompute"]["tokens_per_sec"]
    print(
        f"cpu-debug model ({settings.model.dim}d x {settings.model.n_layers}), prompt {args.prompt}, "
        f"{args.new} new tokens, 1 thread, fp32, median of {args.repeat}"
    )
    print(f"{'mode':<10} {'seconds':>9} {'tokens/s':>10}")
    for mode, row in rows.items():
        print(f"{mode:<10} {row['seconds']:>9.3f} {row['tokens_per_sec']:>10.1f}")
    print(f"speed-up of the KV cache: {speedup:.2f}x; same tokens: {outputs['cached'] == outputs['recompute']}")
    result = {
        "profile": "cpu-debug",
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "threads": 1,
        "repeat": args.repeat,
        "modes": rows,
        "cache_speedup": speedup,
        "same_tokens": outputs["cached"] == outputs["recompute"],
    }
    out = HERE / "results" / "generate_speed.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
