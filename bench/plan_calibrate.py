"""Calibration: fit the layout search's cost-model constants to measured trials.

Input: a trial directory written by `kforge validate-config --plan --search --trial K`
(TRIAL_DIR/trials.json and each trial's profile.toml), or, without ``--trials``, a fresh CPU
sweep: a tiny model on ``--world-size`` gloo ranks, ``--k`` trials of ``--steps`` steps (kept in
bench/results/plan-calibrate-trials-*).

The fit: the cost model (``plan.search.predict_step``, the same code the search runs) is
evaluated on a grid of ``plan.mfu`` x one collective bandwidth (``plan.intra_node_gbps`` =
``plan.inter_node_gbps``) x one overlap share (fsdp, tp, cp, ep and pp alike) x
``plan.full_speed_tokens``, and the point
with the least mean squared log error of the predicted against the measured step time wins.
The error is in-sample: with a handful of trials it says how well the model's *shape* fits,
not how well it predicts a new layout. Prints the table of predicted (defaults and fitted)
against measured and the fitted ``[plan]`` section; writes bench/results/plan_calibrate.json.

    python bench/plan_calibrate.py [--trials DIR] [--k 6] [--steps 10] [--world-size 4]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kforge_cli.engine.plan.search import predict_step
from kforge_cli.engine.plan.shards import build_template
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent
TINY = [
    "--model.dim=64",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=128",
]
MFUS = [round(0.01 * 1.2**i, 4) for i in range(26)]  # 0.01 .. 0.95
GBPS = [round(0.05 * 1.4**i, 3) for i in range(30)]  # 0.05 .. 870
OVERLAPS = [0.0, 0.25, 0.5, 0.75, 0.9]
FULL_SPEED = [256, 1024, 4096, 16384]


def run_sweep(world: int, k: int, steps: int, out: Path) -> None:
    argv = [sys.executable, "-m", "kforge_cli", "validate-config", "--plan", "--search", *TINY]
    argv += [f"--slurm.gpus_per_node={world}", "--world-size", str(world), "--top", str(k)]
    argv += ["--trial", str(k), "--steps", str(steps), "--trial-dir", str(out)]
    subprocess.run(argv, check=True)


def _with_plan(settings: Any, mfu: float, gbps: float, overlap: float, full: int) -> Any:
    plan = settings.plan.model_copy(
        update={
            "mfu": mfu,
            "full_speed_tokens": full,
            "intra_node_gbps": gbps,
            "inter_node_gbps": gbps,
            **{f"{k}_overlap": overlap for k in ("fsdp", "tp", "cp", "ep", "pp")},
        }
    )
    return settings.model_copy(update={"plan": plan})


def main() -> None:
    parser = argparse.ArgumentParser(description="Fit the cost model's constants to measured trials.")
    parser.add_argument("--trials", type=Path, help="a --trial-dir with trials.json (default: run a CPU sweep)")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    trial_dir = args.trials
    if trial_dir is None:  # kept under bench/results/ for a later --trials run
        trial_dir = HERE / "results" / f"plan-calibrate-trials-{time.strftime('%Y%m%d-%H%M%S')}"
        run_sweep(args.world_size, args.k, args.steps, trial_dir)
    summary = json.loads((trial_dir / "trials.json").read_text())
    trials = [t for t in summary["trials"] if t["measured_step_s"] is not None]
    if not trials:
        sys.exit("no trial finished: nothing to fit")
    cases = []
    for t in trials:
        settings = load_settings(profile=t["profile"], use_env=False).settings
        cases.append((t, settings, build_template(settings)))

    def predictions(point: tuple[float, float, float, int] | None) -> list[float]:
        out = []
        for t, settings, template in cases:
            s = settings if point is None else _with_plan(settings, *point)
            out.append(predict_step(s, t["world_size"], template=template).step_s)
        return out

    measured = [t["measured_step_s"] for t, _, _ in cases]

    def loss(pred: list[float]) -> float:
        return sum(math.log(p / m) ** 2 for p, m in zip(pred, measured, strict=True)) / len(pred)

    default = predictions(None)
    best: tuple[float, tuple[float, float, float, int]] = (math.inf, (0.0, 0.0, 0.0, 0))
    for mfu in MFUS:
        for gbps in GBPS:
            for overlap in OVERLAPS:
                for full in FULL_SPEED:
                    value = loss(predictions((mfu, gbps, overlap, full)))
                    if value < best[0]:
                        best = (value, (mfu, gbps, overlap, full))
    mfu, gbps, overlap, full = best[1]
    fitted = predictions(best[1])

    def err(p: float, m: float) -> float:
        return (p - m) / m

    print(
        f"{summary['gpu_type']} x {summary['world_size']}, {summary['steps']} steps per trial ({summary['launcher']})"
    )
    print(f"{'#':>2} {'measured':>9} {'default':>9} {'error':>7} {'fitted':>9} {'error':>7}  layout")
    rows = []
    for (t, _, _), m, d, f in zip(cases, measured, default, fitted, strict=True):
        print(f"{t['index']:>2} {m:>8.3f}s {d:>8.3f}s {err(d, m):>+7.0%} {f:>8.3f}s {err(f, m):>+7.0%}  {t['layout']}")
        rows.append({"trial": t["index"], "layout": t["layout"], "measured_s": m, "default_s": d, "fitted_s": f})
    mean_default = sum(abs(err(d, m)) for d, m in zip(default, measured, strict=True)) / len(cases)
    mean_fitted = sum(abs(err(f, m)) for f, m in zip(fitted, measured, strict=True)) / len(cases)
    rank_measured = sorted(range(len(cases)), key=lambda i: measured[i])
    rank_fitted = sorted(range(len(cases)), key=lambda i: fitted[i])
    print(f"mean |error|: defaults {mean_default:.0%}, fitted {mean_fitted:.0%} (in-sample)")
    print(f"ranking by measurement {rank_measured}, by the fitted model {rank_fitted}")
    print("fitted constants (paste into the profile):")
    print(f"[plan]\nmfu = {mfu}\nintra_node_gbps = {gbps}\ninter_node_gbps = {gbps}\nfull_speed_tokens = {full}")
    for kind in ("fsdp", "tp", "cp", "ep", "pp"):
        print(f"{kind}_overlap = {overlap}")
    out = HERE / "results" / "plan_calibrate.json"
    out.parent.mkdir(exist_ok=True)
    result = {
        "gpu_type": summary["gpu_type"],
        "world_size": summary["world_size"],
        "steps": summary["steps"],
        "fitted": {"mfu": mfu, "gbps": gbps, "overlap": overlap, "full_speed_tokens": full},
        "mean_abs_error_default": mean_default,
        "mean_abs_error_fitted": mean_fitted,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
