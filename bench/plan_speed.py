"""Benchmark: how long `kforge plan` takes for a 70B model at world size 64 and 1024.

Two numbers per layout: the plan itself in this process (``build_plan``: the meta build
under a fake process group plus the estimates; median of ``--repeat`` runs, torch already
imported), and the whole command in a fresh subprocess (Python start, torch import,
settings, plan, report) as a user runs it. Wall and CPU seconds are both reported: on a
shared machine the wall time includes waiting for a core. Target: under 10 s for 70B @ 64.
Prints a table, writes bench/results/plan_speed.json.

    python bench/plan_speed.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kforge_cli.engine.plan.planner import build_plan
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent
LAYOUTS = [
    # name, profile, overrides, world size, rank
    ("70B tp8 x dp8", "llama70b-h100x64", [], 64, 63),
    ("70B tp8 x dp128", "llama70b-h100x64", ["--slurm.nodes=128", "--distributed.dp_shard=128"], 1024, 1023),
    ("8B fsdp64", "h100x64", ["--distributed.tp=1"], 64, 63),
]


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def in_process(profile: str, overrides: list[str], world: int, rank: int, repeat: int) -> dict[str, float]:
    settings = load_settings(profile=profile, overrides=overrides).settings
    walls, cpus = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        build_plan(settings, world, rank)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def byte_data_stub(root: Path) -> Path:
    """A prepared-data directory holding only a byte-tokenizer metadata.json: what validate-config reads.

    GPU profiles refuse to validate without a `data.path` (they would train on the demo corpus).
    """
    meta = {"format": "kforge-tokens", "format_version": 1, "vocab_size": 257, "eos_id": 256}
    meta["tokenizer"] = {"kind": "byte", "vocab_size": 257, "eos_id": 256}
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def command(profile: str, overrides: list[str], world: int, rank: int, data: Path) -> dict[str, float]:
    argv = [
        sys.executable,
        "-m",
        "kforge_cli",
        "plan",
        "--profile",
        profile,
        *overrides,
        "--world-size",
        str(world),
        "--rank",
        str(rank),
    ]
    c0, w0 = _cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - w0
    if proc.returncode not in (0, 1):
        raise RuntimeError(proc.stderr[-2000:])
    verdict = "FITS" if proc.returncode == 0 else "DOES NOT FIT"
    return {"wall_s": wall, "cpu_s": _cpu_seconds(resource.RUSAGE_CHILDREN) - c0, "verdict": verdict}  # type: ignore[dict-item]


def main() -> None:
    parser = argparse.ArgumentParser(description="Time kforge plan for a 70B model at world 64 and 1024.")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = byte_data_stub(Path(tmp))
        for name, profile, overrides, world, rank in LAYOUTS:
            plan = in_process(profile, overrides, world, rank, args.repeat)
            cmd = command(profile, overrides, world, rank, data)
            rows.append({"layout": name, "world_size": world, "rank": rank, "plan": plan, "command": cmd})
    print(
        f"{'layout':<18}{'world':>6}  {'plan wall':>10}{'plan cpu':>10}  {'command wall':>13}{'command cpu':>12}  verdict"
    )
    for r in rows:
        p, c = r["plan"], r["command"]
        print(
            f"{r['layout']:<18}{r['world_size']:>6}  {p['wall_s']:>9.2f}s{p['cpu_s']:>9.2f}s  "
            f"{c['wall_s']:>12.2f}s{c['cpu_s']:>11.2f}s  {c['verdict']}"
        )
    out = HERE / "results" / "plan_speed.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
