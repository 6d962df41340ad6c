"""Benchmark: checkpoint save/load throughput of a ~1 GB training state on this disk.

The state is a kforge Transformer (about 84M fp32 parameters at the defaults: 1.0 GB with the moments) plus its
AdamW moments and step counters, saved through `CheckpointManager` exactly as training
does: sync (the loop waits for everything), async (the loop waits only while the state
is copied to memory; the write, the commit marker and `latest` follow in the background),
and loaded by `restore` into a fresh model and optimizer. Before every load the files
are evicted from the page cache (posix_fadvise DONTNEED after fsync), so loads read the
disk. MB/s counts the tensor bytes of the state (1 MB = 2**20 bytes).

The yardstick is `dd` writing 1 GB with fsync (conv=fsync) into the same directory in
the same run, before and after the checkpoints (the machine is shared, so the disk's
speed drifts). Every figure is printed as a ratio to it: sync save MB/s / dd MB/s, async
loop-blocked time / sync save time, load MB/s / dd write MB/s. The async staging buffer's
extra host memory is reported twice: the bytes its buffers hold, and the growth of this
process's resident set (VmRSS) from before the first async save to after the last.
Prints a table, writes bench/results/checkpoint_io.json.

    python bench/checkpoint_io.py [--runs 3] [--dim 1024] [--layers 7] [--vocab 4096] [--dir DIR] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.checkpoint import CheckpointManager, RunParts
from kforge_cli.engine.checkpoint.dcp_io import state_nbytes, training_state_dict
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train.optim.optimizer import build_optimizer
from kforge_cli.engine.train.optim.scheduler import build_scheduler
from kforge_cli.engine.train.recipe import build_checkpointer
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent
MB = 2**20


def build(run_dir: Path, args: argparse.Namespace, extra: list[str]) -> CheckpointManager:
    """A checkpoint manager over a fresh model, AdamW and scheduler, as training builds them."""
    overrides = [
        f"--model.dim={args.dim}",
        f"--model.n_layers={args.layers}",
        f"--model.vocab_size={args.vocab}",
        "--model.n_heads=16",
        "--train.device=cpu",
        "--checkpoint.keep_last_n=0",
        *extra,
    ]
    s = load_settings(overrides=overrides, use_env=False).settings
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    opt = build_optimizer(model, s.optimizer)
    mgr = build_checkpointer(
        s,
        runtime,
        run_dir,
        RunParts(model, opt, build_scheduler(opt, s.scheduler, s.train.max_steps, s.data.phases), TrainState()),
    )
    training_state_dict(model, opt)  # materialises the AdamW moments (zeros), as after a first step
    return mgr


def evict(path: Path) -> None:
    """Drop `path`'s files from the page cache so the next read comes from the disk."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dd_write(directory: Path, mb: int = 1024) -> dict[str, float]:
    """`dd` of `mb` MiB of zeros with fsync (conv=fsync) into `directory`: the disk's write speed."""
    target = directory / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mb}", "conv=fsync"], check=True, capture_output=True
    )
    seconds = time.perf_counter() - t0
    target.unlink()
    return {"total_s": seconds, "mb": float(mb), "mb_per_s": mb / seconds}


def rss_mb() -> float:
    """This process's resident set now (VmRSS, MB)."""
    text = Path("/proc/self/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024 if match else float("nan")


def bench_saves(root: Path, args: argparse.Namespace, mode: str) -> list[dict[str, float]]:
    mgr = build(root / mode, args, [f"--checkpoint.async_mode={mode}", *args.extra])
    mgr.restore()
    rss0 = rss_mb()
    out = []
    for run in range(1, args.runs + 1):
        t0 = time.perf_counter()
        mgr.save(run)
        returned = time.perf_counter() - t0
        mgr.wait()
        rec = mgr.history[-1]
        assert rec.total_s is not None
        # returned_s: how long save() held the training loop (async: the copy to memory only).
        out.append(
            {
                "returned_s": returned,
                "total_s": rec.total_s,
                "mb": rec.nbytes / MB,
                "mb_per_s": rec.nbytes / MB / rec.total_s,
                "staged_mb": getattr(mgr, "staged_nbytes", 0) / MB,  # 0 on a kforge without reusable staging
                "rss_growth_mb": rss_mb() - rss0,
            }
        )
        shutil.rmtree(root / mode / "checkpoints" / f"step_{run - 1}", ignore_errors=True)
    return out


def bench_loads(root: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    step_dir = root / "disabled" / "checkpoints" / f"step_{args.runs}"
    out = []
    for run in range(args.runs):
        mgr = build(root / f"load{run}", args, [f"--checkpoint.load_path={step_dir}", *args.extra])
        nbytes = state_nbytes(training_state_dict(mgr.parts.model, mgr.parts.optimizer))
        evict(step_dir)
        t0 = time.perf_counter()
        mgr.restore()
        seconds = time.perf_counter() - t0
        out.append({"total_s": seconds, "mb": nbytes / MB, "mb_per_s": nbytes / MB / seconds})
        del mgr
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dir", type=Path, default=None, help="Where to write (default: a temp dir in /tmp).")
    p.add_argument("--tag", default="", help="Suffix of the JSON file name (checkpoint_io[-TAG].json).")
    p.add_argument("--dd-mb", type=int, default=1024, help="MiB that the dd yardstick writes")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="one run of a tiny state, an 8 MiB dd, no results file (checks the script)",
    )
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        help="Extra override, e.g. --set=--checkpoint.write_threads=1.",
    )
    args = p.parse_args()
    if args.smoke:
        args.runs, args.dim, args.layers, args.vocab, args.dd_mb = 1, 64, 1, 256, 8
    root = Path(tempfile.mkdtemp(prefix="kforge-ckpt-bench-", dir=args.dir))
    try:
        dd_before = dd_write(root, args.dd_mb)
        results: dict[str, Any] = {
            "sync": bench_saves(root, args, "disabled"),
            "async": bench_saves(root, args, "async"),
            "load": bench_loads(root, args),
        }
        results["dd"] = [dd_before, dd_write(root, args.dd_mb)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: summary(v) for k, v in results.items()}
    dd = statistics.mean(r["mb_per_s"] for r in results["dd"])
    ratios = {
        "sync_save_vs_dd": med["sync"]["mb_per_s"] / dd,
        "async_blocked_vs_sync_save": med["async"]["returned_s"] / med["sync"]["total_s"],
        "async_save_vs_dd": med["async"]["mb_per_s"] / dd,
        "load_vs_dd_write": med["load"]["mb_per_s"] / dd,
    }
    targets = {
        "sync_save_vs_dd": (">=", 0.8),
        "async_blocked_vs_sync_save": ("<=", 0.10),
        "load_vs_dd_write": (">=", 1.0),
    }
    print(f"state {med['sync']['mb']:.0f} MB (model + AdamW), {args.runs} runs each, medians, dir {root.parent}")
    dd_runs = " / ".join(f"{r['mb_per_s']:.0f}" for r in results["dd"])
    print(f"dd {args.dd_mb} MiB conv=fsync: {dd_runs} MB/s (before / after), mean {dd:.0f}")
    print(f"{'':6} {'MB/s':>8} {'x dd':>6} {'total s':>8} {'loop blocked s':>15} {'blocked / sync':>15}")
    for name in ("sync", "async"):
        m = med[name]
        blocked = m["returned_s"] / med["sync"]["total_s"]
        print(
            f"{name:6} {m['mb_per_s']:8.0f} {m['mb_per_s'] / dd:6.2f} {m['total_s']:8.2f} {m['returned_s']:15.3f} {blocked:15.3f}"
        )
    m = med["load"]
    print(f"{'load':6} {m['mb_per_s']:8.0f} {m['mb_per_s'] / dd:6.2f} {m['total_s']:8.2f} {'-':>15} {'-':>15}")
    a = med["async"]
    print(
        f"async staging buffer: {a['staged_mb']:.0f} MB held; RSS growth over the async saves {a['rss_growth_mb']:.0f} MB"
    )
    for key, (op, bound) in targets.items():
        ok = ratios[key] >= bound if op == ">=" else ratios[key] <= bound
        print(f"  {key:28} {ratios[key]:6.3f}  target {op} {bound}  {'met' if ok else 'NOT met'}")
    if args.smoke:  # checks the script; its figures mean nothing
        return
    name = f"checkpoint_io-{args.tag}.json" if args.tag else "checkpoint_io.json"
    out = HERE / "results" / name
    out.parent.mkdir(exist_ok=True)
    info = {"torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(), "dir": str(root.parent)}
    info["overrides"] = args.extra
    out.write_text(json.dumps({"env": info, "ratios": ratios, "median": med, "runs": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
