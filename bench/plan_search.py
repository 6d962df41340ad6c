"""Benchmark: how long `kforge plan search` takes, up to a 70B model on 1024 GPUs.

Per case: the search in this process (``search_layouts``: the template build, every layout's
prediction, then the rules and the memory plan from the fastest down until the top 5
meshes fit; median of ``--repeat`` runs, torch already imported), wall and CPU seconds (on a
shared machine the wall time includes waiting for a core), how many layouts were predicted
and checked, and the best layout; then the whole command for 70B on 1024 GPUs in a fresh
subprocess (Python start, torch import, settings, search, report) as a user runs it.
Target: under 10 s for 70B on 1024 GPUs. Prints a table, writes bench/results/plan_search.json.

    python bench/plan_search.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kforge_cli.engine.plan.search import search_layouts
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent
BIG = ["--slurm.nodes=128", "--distributed.dp_shard=128", "--train.grad_accum_steps=4"]  # 512 x 8192 tokens
CASES = [
    # name, profile, overrides, world size
    ("8B @ 64", "h100x64", [], 64),
    ("70B @ 64", "llama70b-h100x64", [], 64),
    ("MoE 16B @ 64", "moe16b-h100x64", [], 64),
    ("70B @ 1024", "llama70b-h100x64", BIG, 1024),
]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def in_process(profile: str, overrides: list[str], world: int, repeat: int) -> dict[str, object]:
    settings = load_settings(profile=profile, overrides=overrides, use_env=False).settings
    walls, cpus = [], []
    result = None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        result = search_layouts(settings, world)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    assert result is not None and result.top
    best = result.top[0]
    return {
        "wall_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
        "predicted": result.enumerated,
        "checked": result.checked,
        "best": best.layout.describe(),
        "best_step_s": best.estimate.step_s,
        "best_peak_gib": best.peak_bytes / 2**30,
    }


def command(profile: str, overrides: list[str], world: int) -> dict[str, float]:
    argv = [sys.executable, "-m", "kforge_cli", "plan", "search", "--profile", profile, "--world-size", str(world)]
    argv += overrides
    c0, w0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - w0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return {"wall_s": wall, "cpu_s": _children_cpu() - c0}


def main() -> None:
    parser = argparse.ArgumentParser(description="Time kforge plan search up to 70B on 1024 GPUs.")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name, profile, overrides, world in CASES:
        rows.append({"case": name, "world_size": world, **in_process(profile, overrides, world, args.repeat)})
    load = os.getloadavg()[0]
    whole = command("llama70b-h100x64", BIG, 1024)
    print(f"{'case':<14}{'wall':>8}{'cpu':>8}{'predicted':>11}{'checked':>9}  best layout (predicted step, peak)")
    for r in rows:
        print(
            f"{r['case']:<14}{r['wall_s']:>7.2f}s{r['cpu_s']:>7.2f}s{r['predicted']:>11,}{r['checked']:>9,}  "
            f"{r['best']} ({r['best_step_s']:.3g} s, {r['best_peak_gib']:.1f} GiB)"
        )
    print(
        f"whole command, 70B @ 1024: {whole['wall_s']:.2f} s wall, {whole['cpu_s']:.2f} s CPU "
        f"(1-minute load average {load:.1f} on {os.cpu_count()} CPUs)"
    )
    out = HERE / "results" / "plan_search.json"
    out.parent.mkdir(exist_ok=True)
    result = {"repeat": args.repeat, "rows": rows, "command_70b_1024": whole, "load_average": load}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
