"""Benchmark (GPU): training tokens/s with document masking, FlexAttention vs dense-mask SDPA.

Both run kforge's Transformer (bf16 weights) on the same packed batch (``--seq-len``
tokens per sequence, documents of random lengths) for forward + backward, in one process,
alternating the backends; plain causal SDPA (``is_causal``, flash, no document mask) is the
reference ceiling. Compile time and warm-up steps are excluded. Prints a table and writes
bench/results/attention_speed.json (``tokens_per_s`` and, on CUDA, ``peak_mem_gib`` per
backend (the three models' weights included), ``flex_over_dense``); exits non-zero without CUDA unless ``--smoke``.
The GPU acceptance script calls it as

    python bench/attention_speed.py [--seq-len 8192] [--steps 20] [--out PATH]

``--smoke`` runs tiny shapes on CPU, forward only (FlexAttention has no CPU backward), to
check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.settings.training import ModelSettings

HERE = Path(__file__).resolve().parent
BACKENDS = ("flex", "sdpa_dense", "sdpa_causal")  # sdpa_causal: no document mask (the ceiling)


def packed_documents(batch: int, seqlen: int, mean_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_ids, positions)`` ``[batch, seqlen]`` for documents of random lengths around ``mean_len``."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.empty(batch, seqlen, dtype=torch.long)
    pos = torch.empty(batch, seqlen, dtype=torch.long)
    for b in range(batch):
        t, d = 0, 0
        while t < seqlen:
            n = min(seqlen - t, int(torch.randint(mean_len // 4, 2 * mean_len, (1,), generator=g)))
            docs[b, t : t + n] = d
            pos[b, t : t + n] = torch.arange(n)
            t, d = t + n, d + 1
    return docs, pos


def _model(cfg: ModelSettings, backend: str, device: torch.device, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    attention = "flex" if backend == "flex" else "sdpa"
    with torch.device(device):
        model = Transformer(cfg.model_copy(update={"attention": attention}))
    return model.to(dtype)


def _step(model: Transformer, batch: dict[str, torch.Tensor], backend: str, train: bool) -> None:
    kwargs = {} if backend == "sdpa_causal" else {"doc_ids": batch["doc_ids"], "positions": batch["positions"]}
    if not train:
        with torch.no_grad():
            model(batch["input_ids"], **kwargs)
        return
    logits = model(batch["input_ids"], **kwargs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("attention_speed needs CUDA (use --smoke for the CPU check of the script)")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = ModelSettings(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_seq_len=args.seq_len,
    )
    docs, pos = packed_documents(args.batch, args.seq_len, args.mean_doc_len, seed=0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batch = {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "doc_ids": docs,
        "positions": pos,
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    train = not args.smoke
    models = {b: _model(cfg, b, device, dtype) for b in BACKENDS}
    for b in BACKENDS:  # warm-up (compiles flex once per process)
        for _ in range(args.warmup):
            _step(models[b], batch, b, train)
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    peaks: dict[str, int] = dict.fromkeys(BACKENDS, 0)  # the step's peak allocation (CUDA only)
    for _ in range(args.steps):
        for b in BACKENDS:  # alternate, so drifts in clocks hit every backend alike
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            _step(models[b], batch, b, train)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peaks[b] = max(peaks[b], torch.cuda.max_memory_allocated())
            times[b].append(time.perf_counter() - t0)
    tokens_per_step = args.batch * args.seq_len
    rows = {
        b: {
            "step_s": statistics.median(ts),
            "tokens_per_s": tokens_per_step / statistics.median(ts),
            "peak_mem_gib": peaks[b] / 2**30 if device.type == "cuda" else None,
        }
        for b, ts in times.items()
    }
    n_docs = int((docs[:, 1:] != docs[:, :-1]).sum()) + args.batch
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "mode": "forward+backward" if train else "forward (smoke)",
        "seq_len": args.seq_len,
        "batch": args.batch,
        "documents": n_docs,
        "model": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads},
        "backends": rows,
        "flex_over_dense": rows["flex"]["tokens_per_s"] / rows["sdpa_dense"]["tokens_per_s"],
    }
    print(f"attention speed: {result['device']}, {result['mode']}, {args.batch} x {args.seq_len} tokens, {n_docs} docs")
    print(f"{'backend':<14}{'step (ms)':>12}{'tokens/s':>14}{'peak GiB':>10}")
    for b, r in rows.items():
        peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        print(f"{b:<14}{r['step_s'] * 1e3:12.2f}{r['tokens_per_s']:14,.0f}{peak:>10}")
    print(f"flex / dense-mask SDPA tokens/s: {result['flex_over_dense']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run, forward only (checks the script)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--mean-doc-len", type=int, default=1024)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "attention_speed.json")
    args = p.parse_args(argv)
    if args.smoke:  # shapes a 2-core CPU runs in seconds
        args.seq_len, args.mean_doc_len, args.dim, args.layers = min(args.seq_len, 256), 64, 64, 2
        args.heads, args.kv_heads, args.vocab, args.steps, args.warmup = 4, 2, 256, 2, 1
    return args


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
