"""Benchmark: Muon's Newton-Schulz work per rank, split over the ranks against gathered on every rank.

For 1, 2 and 4 gloo processes (one thread each) a kforge Transformer is FSDP2-sharded over
every rank and Muon (``build_optimizer``) steps it with seeded gradients, once with
``optimizer.muon_distributed=true`` (each matrix orthogonalised by one owner rank) and once
with ``false`` (every rank gathers and orthogonalises every matrix, as before). Per rank:
the Newton-Schulz FLOPs of a step (analytic, ``Muon.ns_flops_last_step``: per iteration
4 m^2 n + 2 m^3 for an m x n matrix, m <= n), and the median wall and CPU time of
``optimizer.step()`` (the step also runs AdamW on the embedding, head and norms).
Expected: FLOPs per rank ~1/N of one process's with the split, 1x gathered; time likewise
where each process has a core of its own (on a 2-core machine 4 processes share 2 cores:
compare CPU time there). Prints a table, writes bench/results/muon_distributed.json.

    python bench/muon_distributed.py [--ranks 1 2 4] [--steps 6] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    from kforge_cli.engine.families.llama import Transformer
    from kforge_cli.engine.train.optim import build_optimizer
    from kforge_cli.engine.train.optim.muon import Muon
    from kforge_cli.settings import load_settings

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows: list[dict[str, Any]] = []
    for split in (True, False) if world > 1 else (True,):
        settings = load_settings(
            overrides=[
                f"--model.dim={args.dim}",
                f"--model.n_layers={args.layers}",
                f"--model.n_heads={max(1, args.dim // 64)}",
                f"--model.n_kv_heads={max(1, args.dim // 128)}",
                "--model.vocab_size=512",
                "--model.max_seq_len=64",
                "--train.seq_len=32",
                "--optimizer.name=muon",
                f"--optimizer.muon_distributed={str(split).lower()}",
            ]
        ).settings
        torch.manual_seed(0)
        model = Transformer(settings.model)
        model.init_weights()
        if world > 1:
            for block in model.layers.values():  # type: ignore[union-attr]
                fully_shard(block)
            fully_shard(model)
        opt = build_optimizer(model, settings)
        assert isinstance(opt, Muon)
        wall, cpu, flops = [], [], []
        for step in range(args.warmup + args.steps):
            gen = torch.Generator().manual_seed(step)
            for p in model.parameters():
                g = torch.randn(p.shape, generator=gen)
                p.grad = (
                    distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor)
                    else g
                )
            if world > 1:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.step()
            if world > 1:
                dist.barrier()
            t1, c1 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            if step >= args.warmup:
                wall.append(t1 - t0)
                cpu.append(c1 - c0)
                flops.append(opt.ns_flops_last_step)
        rows.append(
            {
                "ranks": world,
                "rank": rank,
                "mode": "split" if split and world > 1 else ("one process" if world == 1 else "gathered"),
                "ns_flops": flops[-1],
                "step_wall_s": statistics.median(wall),
                "step_cpu_s": statistics.median(cpu),
            }
        )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(args.worker).write_text(json.dumps([r for rs in gathered for r in rs]))
    dist.barrier()
    dist.destroy_process_group()


def launch(n: int, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--dim={args.dim}",
        f"--layers={args.layers}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode or not out.is_file():
        raise SystemExit(f"{n} ranks failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            rows += launch(n, args, Path(tmp) / f"ranks{n}.json")
    one = [r for r in rows if r["ranks"] == 1]
    base_flops = one[0]["ns_flops"] if one else max(r["ns_flops"] for r in rows)
    base_wall = one[0]["step_wall_s"] if one else None
    base_cpu = one[0]["step_cpu_s"] if one else None
    summary = []
    for n in args.ranks:
        for mode in ("one process", "split", "gathered"):
            rs = [r for r in rows if r["ranks"] == n and r["mode"] == mode]
            if not rs:
                continue
            flops = max(r["ns_flops"] for r in rs)
            wall = max(r["step_wall_s"] for r in rs)
            cpu = max(r["step_cpu_s"] for r in rs)
            summary.append(
                {
                    "ranks": n,
                    "mode": mode,
                    "ns_gflop_per_rank_max": flops / 1e9,
                    "ns_gflop_per_rank": [r["ns_flops"] / 1e9 for r in sorted(rs, key=lambda r: r["rank"])],
                    "flops_vs_one_process": flops / base_flops,
                    "step_wall_s": wall,
                    "step_cpu_s": cpu,
                    "wall_vs_one_process": wall / base_wall if base_wall else None,
                    "cpu_vs_one_process": cpu / base_cpu if base_cpu else None,
                }
            )
    print(f"model dim {args.dim}, {args.layers} layers; median of {args.steps} steps; slowest rank")
    print(
        f"{'ranks':>5}  {'mode':<12}{'NS GFLOP/rank':>14}{'x 1 proc':>9}{'step wall':>11}{'x 1 proc':>9}{'step cpu':>10}{'x 1 proc':>9}"
    )
    for s in summary:
        wr = f"{s['wall_vs_one_process']:.2f}" if s["wall_vs_one_process"] else "-"
        cr = f"{s['cpu_vs_one_process']:.2f}" if s["cpu_vs_one_process"] else "-"
        print(
            f"{s['ranks']:>5}  {s['mode']:<12}{s['ns_gflop_per_rank_max']:>14.2f}{s['flops_vs_one_process']:>9.2f}"
            f"{s['step_wall_s']:>10.3f}s{wr:>9}{s['step_cpu_s']:>9.3f}s{cr:>9}"
        )
    out = HERE / "results" / "muon_distributed.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
