"""Benchmark: checkpoint save/load throughput of a ~1 GB training state on this disk.

The state is a kforge Transformer (about 84M fp32 parameters at the defaults: 1.0 GB with the moments) plus its
AdamW moments and step counters, saved through `CheckpointManager` exactly as training
does: sync (the loop waits for everything), async (the loop waits only while the state
is copied to memory; the write, the commit marker and `latest` follow in the background),
and loaded by `restore` into a fresh model and optimizer. Before every load the files
are evicted from the page cache (posix_fadvise DONTNEED after fsync), so loads read the
disk. MB/s counts the tensor bytes of the state (1 MB = 2**20 bytes). Prints a table,
writes bench/results/checkpoint_io.json.

    python bench/checkpoint_io.py [--runs 3] [--dim 1024] [--layers 7] [--vocab 4096] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.checkpoint import CheckpointManager
from kforge_cli.engine.checkpoint.dcp_io import state_nbytes, training_state_dict
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train.optimizer import build_optimizer
from kforge_cli.engine.train.scheduler import build_scheduler
from kforge_cli.engine.train.session import TrainState
from kforge_cli.settings import load_settings

HERE = Path(__file__).resolve().parent
MB = 2**20


def build(run_dir: Path, args: argparse.Namespace, extra: list[str]) -> CheckpointManager:
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
    opt = build_optimizer(model, s)
    mgr = CheckpointManager(s, runtime, run_dir, model=model, optimizer=opt, scheduler=build_scheduler(opt, s))
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


def bench_saves(root: Path, args: argparse.Namespace, mode: str) -> list[dict[str, float]]:
    mgr = build(root / mode, args, [f"--checkpoint.async_mode={mode}"])
    mgr.restore(progress=TrainState())
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
            }
        )
        shutil.rmtree(root / mode / "checkpoints" / f"step_{run - 1}", ignore_errors=True)
    return out


def bench_loads(root: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    step_dir = root / "disabled" / "checkpoints" / f"step_{args.runs}"
    out = []
    for run in range(args.runs):
        mgr = build(root / f"load{run}", args, [f"--checkpoint.load_path={step_dir}"])
        nbytes = state_nbytes(training_state_dict(mgr.model, mgr.optimizer))
        evict(step_dir)
        t0 = time.perf_counter()
        mgr.restore(progress=TrainState())
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
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kforge-ckpt-bench-", dir=args.dir))
    try:
        results: dict[str, Any] = {
            "sync": bench_saves(root, args, "disabled"),
            "async": bench_saves(root, args, "async"),
            "load": bench_loads(root, args),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: summary(v) for k, v in results.items()}
    print(f"state {med['sync']['mb']:.0f} MB (model + AdamW), {args.runs} runs each, medians, dir {root.parent}")
    print(f"{'':6} {'MB/s':>8} {'total s':>8} {'loop blocked s':>15}")
    for name in ("sync", "async"):
        m = med[name]
        print(f"{name:6} {m['mb_per_s']:8.0f} {m['total_s']:8.2f} {m['returned_s']:15.3f}")
    print(f"{'load':6} {med['load']['mb_per_s']:8.0f} {med['load']['total_s']:8.2f} {'-':>15}")
    out = HERE / "results" / "checkpoint_io.json"
    out.parent.mkdir(exist_ok=True)
    info = {"torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(), "dir": str(root.parent)}
    out.write_text(json.dumps({"env": info, "median": med, "runs": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
