"""Benchmark: `kforge train` (no arguments but fewer steps) on a quiet machine vs next to a
CPU-bound competitor that this script starts itself.

The default thread choice (engine/runtime/threads.py) should keep at least half of the
quiet tokens/s when one core is taken; for comparison the same runs with the thread count
pinned to every core (torch's old default, `--train.num_threads=N`) show what it avoids.
tokens/s is the median of the logged steps after the first `--skip` records. Prints a
table, writes bench/results/train_contention.json.

    python bench/train_contention.py [--steps 120] [--skip 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPETITOR = "while True: pass"


def run_train(steps: int, skip: int, extra: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "kforge_cli", "train", "--run-dir", str(run), f"--train.max_steps={steps}"]
        cmd += ["--eval.interval=0", "--checkpoint.interval=0", "--metrics.progress_bar=off", *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"kforge train failed ({proc.returncode}): {proc.stderr[-2000:]}")
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][skip:]
        return statistics.median(rates)


def measure(steps: int, skip: int, extra: list[str], competitor: bool) -> float:
    if not competitor:
        return run_train(steps, skip, extra)
    busy = subprocess.Popen([sys.executable, "-c", COMPETITOR])
    try:
        return run_train(steps, skip, extra)
    finally:
        busy.kill()
        busy.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--skip", type=int, default=2, help="logged records (every 10 steps) to skip as warm-up")
    parser.add_argument("--smoke", action="store_true", help="20 steps, default threads only, no results file")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.skip = 20, 0
    cores = len(os.sched_getaffinity(0))
    rows = []
    configs: list[tuple[str, list[str]]] = [("default threads", [])]
    if not args.smoke:
        configs.append((f"num_threads={cores} (old default)", [f"--train.num_threads={cores}"]))
    for label, extra in configs:
        quiet = measure(args.steps, args.skip, extra, competitor=False)
        busy = measure(args.steps, args.skip, extra, competitor=True)
        rows.append({"config": label, "quiet_tok_s": quiet, "competitor_tok_s": busy, "kept": busy / quiet})
    print(f"kforge train, {args.steps} steps, {cores} cores, competitor = 1 busy-loop process")
    print(f"{'config':<32} {'quiet tok/s':>12} {'competitor tok/s':>17} {'kept':>6}")
    for r in rows:
        print(f"{r['config']:<32} {r['quiet_tok_s']:>12,.0f} {r['competitor_tok_s']:>17,.0f} {r['kept']:>6.2f}")
    if args.smoke:  # checks the script; its figures mean nothing
        return
    out = HERE / "results" / "train_contention.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "cores": cores, "rows": rows, "target_kept": 0.5}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
