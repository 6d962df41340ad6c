"""Calibration: fit the cost model's constants to measured trials (`kforge plan calibrate`).

Input: a trial directory written by `kforge plan trial` (``--trials DIR``), or, without it, a
fresh CPU sweep: a tiny model on ``--world-size`` gloo ranks, ``--k`` trials of ``--steps`` steps
(`kforge plan trial --best K`, kept in bench/results/plan-calibrate-trials-*). The fit itself is
``engine.plan.calibrate`` (what `kforge plan calibrate` runs; its module docstring says how);
this script prints its table and the ``[plan]`` section and writes bench/results/plan_calibrate.json.

    python bench/plan_calibrate.py [--trials DIR] [--k 6] [--steps 10] [--world-size 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kforge_cli.engine.plan.calibrate import calibrate, format_calibration, plan_toml

HERE = Path(__file__).resolve().parent
TINY = [
    "--model.dim=64",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=128",
]


def run_sweep(world: int, k: int, steps: int, out: Path) -> None:
    argv = [sys.executable, "-m", "kforge_cli", "plan", "trial", "--world-size", str(world), "--best", str(k)]
    argv += ["--steps", str(steps), "--trial-dir", str(out), f"--slurm.gpus_per_node={world}", *TINY]
    subprocess.run(argv, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="Fit the cost model's constants to measured trials.")
    parser.add_argument("--trials", type=Path, help="a `kforge plan trial` --trial-dir (default: run a CPU sweep)")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    trial_dir = args.trials
    if trial_dir is None:  # kept under bench/results/ for a later --trials run
        trial_dir = HERE / "results" / f"plan-calibrate-trials-{time.strftime('%Y%m%d-%H%M%S')}"
        run_sweep(args.world_size, args.k, args.steps, trial_dir)
    start = time.perf_counter()
    result = calibrate(trial_dir)
    seconds = time.perf_counter() - start
    print(format_calibration(result))
    print(f"fit in {seconds:.1f} s; fitted constants (`kforge plan calibrate {trial_dir} --output FILE` writes them):")
    print(plan_toml(result), end="")
    out = HERE / "results" / "plan_calibrate.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**result.as_dict(), "fit_seconds": seconds}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
