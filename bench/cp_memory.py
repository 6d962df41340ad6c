"""Benchmark: peak activation memory per rank, context parallel cp=2 vs cp=1, same sequence (CPU).

Each layout runs in two fresh gloo processes (cp=1: FSDP over 2 ranks, each with the whole
sequence; cp=2: both ranks share one sequence, FSDP over dp_shard x cp) that build
the real model with `build_parallel_model`, shard the batch with `shard_batch` and run one
forward + backward of the same batch under torch's memory tracker (``MemTracker``, or
``FSDPMemTracker`` under FSDP, as tests/distributed/test_plan_measured.py does): the
activation peak is the ``Activation`` + ``Temp`` categories of the tracker's peak
snapshot. The planner's estimate and the process's RSS peak growth over the step
(engine.observe.memory) are printed next to it. Target: cp=2 / cp=1 about 0.5 (the
gathered K/V, 2 x T x kv_dim per layer, does not shrink). Writes bench/results/cp_memory.json.

    python bench/cp_memory.py [--seq-len 4096] [--documents] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent


def _settings(seq_len: int, cp: int, documents: bool, extra: list[str]) -> list[str]:
    return [
        f"--distributed.dp_shard={2 // cp}",
        "--model.dim=256",
        "--model.n_layers=2",
        "--model.n_heads=4",
        "--model.n_kv_heads=2",
        "--model.vocab_size=512",
        f"--model.max_seq_len={seq_len}",
        f"--train.seq_len={seq_len}",
        "--train.batch_size=1",
        "--train.device=cpu",
        "--train.mixed_precision=fp32",
        "--train.loss_chunk_size=512",
        f"--distributed.cp={cp}",
        f"--data.document_masking={'true' if documents else 'false'}",
        "--train.num_threads=1",
        *extra,
    ]


def _worker(rank: int, world: int, port: int, overrides: list[str], documents: bool, out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    from kforge_cli.engine.observe.memory import peak_memory_stats
    from kforge_cli.engine.parallel import build_parallel_model
    from kforge_cli.engine.parallel.context_parallel import shard_batch
    from kforge_cli.engine.plan.planner import build_plan
    from kforge_cli.engine.runtime import init_runtime
    from kforge_cli.engine.train.loss import build_loss_fn
    from kforge_cli.settings import load_settings

    s = load_settings(overrides=overrides).settings
    plan_peak = build_plan(s, world, rank).activations.peak  # before the process group exists
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    t = s.train
    tokens = torch.randint(
        0, s.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if documents:  # documents of 700 tokens
        doc = torch.arange(t.seq_len) // 700
        batch["doc_ids"] = doc.expand(t.batch_size, -1).contiguous()
        batch["positions"] = (torch.arange(t.seq_len) % 700).expand(t.batch_size, -1).contiguous()
    local = shard_batch(batch, runtime.cp_rank, runtime.cp_size)
    loss_fn = build_loss_fn(s)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model)
    kwargs = {k: local[k] for k in ("doc_ids", "positions") if k in local}
    rss_before = peak_memory_stats(runtime.device)["peak_rss_gib"]
    with tracker:
        loss = model(local["input_ids"], labels=local["labels"], loss_fn=loss_fn, **kwargs)
        loss.backward()
    rss_after = peak_memory_stats(runtime.device)["peak_rss_gib"]
    snap = tracker.get_tracker_snapshot("peak")[runtime.device]
    named = {str(getattr(k, "value", k)): v for k, v in snap.items()}
    result = {
        "rank": rank,
        "activation_peak_bytes": named["Activation"] + named["Temp"],
        "rss_growth_bytes": int((rss_after - rss_before) * 1024**3),
        "plan_activation_peak_bytes": plan_peak,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(seq_len: int, cp: int, documents: bool, extra: list[str], tmp: Path) -> list[dict[str, Any]]:
    out = tmp / f"cp{cp}"
    out.mkdir(parents=True, exist_ok=True)
    args = (2, _free_port(), _settings(seq_len, cp, documents, extra), documents, str(out))
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--documents", action="store_true", help="document masking (dense-mask SDPA on CPU)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "cp_memory.json")
    args, extra = p.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {cp: measure(args.seq_len, cp, args.documents, extra, Path(tmp)) for cp in (1, 2)}
    mib = 1024**2
    print(f"peak activation memory per rank, seq_len {args.seq_len}, documents={args.documents} (MiB)")
    print(f"{'cp':>3} {'rank':>5} {'measured':>10} {'planned':>10} {'RSS growth':>11}")
    for cp, ranks in runs.items():
        for r in ranks:
            planned = r["plan_activation_peak_bytes"] / mib
            print(
                f"{cp:>3} {r['rank']:>5} {r['activation_peak_bytes'] / mib:10.1f} {planned:10.1f} "
                f"{r['rss_growth_bytes'] / mib:11.1f}"
            )
    one = max(r["activation_peak_bytes"] for r in runs[1])
    two = max(r["activation_peak_bytes"] for r in runs[2])
    print(f"ratio cp=2 / cp=1 (largest rank): {two / one:.3f}")
    result = {"seq_len": args.seq_len, "documents": args.documents, "runs": runs, "ratio": two / one}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
