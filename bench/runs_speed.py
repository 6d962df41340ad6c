"""Benchmark: wall time of `kforge runs` over 20 run directories (target: under 1 s, no torch).

Creates 20 runs as training leaves them (config.toml, logs/, metrics.jsonl of 2,000 steps with
an eval every 500, a final checkpoint for half of them, a never-submitted `--sbatch` job for
two), then times the real command in a subprocess, median of N runs after a warm-up. Also
checks, in one extra run, that the command imported no torch. Prints a table and writes
bench/results/runs_speed.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
N_RUNS = 20
STEPS = 2000


def make_runs(root: Path, steps: int = STEPS) -> None:
    from kforge_cli.rundir.layout import RunDir
    from kforge_cli.rundir.names import COMMIT_FILE, DCP_METADATA, SUMMARY_FILE
    from kforge_cli.settings import load_settings
    from kforge_cli.settings.explain import to_toml

    for i in range(N_RUNS):
        run = RunDir(root / f"run-{i:02d}")
        run.logs.mkdir(parents=True)
        overrides = [f"--train.run_dir={run.path}", f"--train.max_steps={steps}"]
        run.config.write_text(to_toml(load_settings(overrides=overrides, use_env=False).settings))
        if i >= N_RUNS - 2:  # written by --sbatch, never submitted
            run.job_script.write_text("#!/bin/bash\n")
            continue
        lines = []
        for step in range(1, steps + 1):
            lines.append(json.dumps({"step": step, "loss": 3.0 + 1.0 / step, "lr": 1e-3, "tokens_seen": 4096 * step}))
            if step % 500 == 0:
                lines.append(json.dumps({"step": step, "eval_loss": 3.1 + 1.0 / step}))
        run.metrics.write_text("\n".join(lines) + "\n")
        (run.logs / "rank_0.log").write_text("log\n")
        if i % 2 == 0:
            step_dir = run.checkpoints / f"step_{steps}"
            step_dir.mkdir(parents=True)
            (step_dir / DCP_METADATA).write_bytes(b"")
            (step_dir / COMMIT_FILE).write_text(json.dumps({"step": steps, "dcp_dirs": ["."]}))
            (step_dir / SUMMARY_FILE).write_text(json.dumps({"step": steps, "reason": "final"}))


def _time(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(repeats: int = 7, smoke: bool = False) -> dict[str, float]:
    kforge = shutil.which("kforge", path=str(Path(sys.executable).parent)) or "kforge"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        make_runs(root, steps=20 if smoke else STEPS)
        cmd = [kforge, "runs", str(root)]
        if not smoke:
            _time(cmd)  # warm the page cache and .pyc files
        times = [_time(cmd) for _ in range(repeats)]
        probe = (
            "import sys\nfrom kforge_cli.cli.app import main\n"
            f"try:\n    main(['runs', {str(root)!r}])\nexcept SystemExit:\n    pass\n"
            "print('TORCH=' + str('torch' in sys.modules))\n"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        rows = len(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()) - 1
    result = {
        "runs": N_RUNS,
        "rows": rows,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "imports_torch": "TORCH=True" in out,
    }
    print(f"{'kforge runs, 20 runs':<26}{'median s':>10}{'min s':>8}{'max s':>8}  torch imported")
    print(
        f"{'':<26}{result['median_s']:>10.3f}{result['min_s']:>8.3f}{result['max_s']:>8.3f}  {result['imports_torch']}"
        "  (target: < 1 s, no torch)"
    )
    if smoke:  # checks the script; its figures mean nothing
        return result
    path = HERE / "results" / "runs_speed.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"repeats": repeats, **result}, indent=2))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repeats", type=int, nargs="?", default=7, help="timed runs of the command (default 7)")
    parser.add_argument(
        "--smoke", action="store_true", help="runs of 20 steps, one timed run, no results file (checks the script)"
    )
    args = parser.parse_args()
    main(1 if args.smoke else args.repeats, smoke=args.smoke)
