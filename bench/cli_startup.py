"""Benchmark: wall time of `kforge --help` vs a bare Typer app with the same five subcommands.

Median of N runs each, alternating so machine noise hits both equally. Prints a table and
writes bench/results/cli_startup.json. Target: kforge within 1.3x of the bare app.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _time(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(runs: int = 10, smoke: bool = False) -> dict[str, float]:
    kforge = shutil.which("kforge", path=str(Path(sys.executable).parent)) or "kforge"
    cmds = {
        "kforge --help": [kforge, "--help"],
        "bare typer --help": [sys.executable, str(HERE / "bare_typer_app.py"), "--help"],
        "kforge validate-config": [kforge, "validate-config"],
    }
    if not smoke:
        for cmd in cmds.values():  # warm the page cache and .pyc files
            _time(cmd)
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            times[name].append(_time(cmd))
    result = {name: statistics.median(ts) for name, ts in times.items()}
    result["ratio_help_vs_bare"] = result["kforge --help"] / result["bare typer --help"]
    print(f"{'command':<26}{'median s':>10}")
    for name in cmds:
        print(f"{name:<26}{result[name]:>10.3f}")
    print(f"{'ratio kforge/bare':<26}{result['ratio_help_vs_bare']:>10.2f}  (target <= 1.30)")
    if smoke:  # checks the script; its figures mean nothing
        return result
    out = HERE / "results" / "cli_startup.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"runs": runs, **result}, indent=2))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=int, nargs="?", default=10, help="runs of each command (default 10)")
    parser.add_argument("--smoke", action="store_true", help="one run, no warm-up, no results file (checks the script)")
    args = parser.parse_args()
    main(1 if args.smoke else args.runs, smoke=args.smoke)
