"""Benchmark: kforge's eager Transformer vs a minimal GPT-2-style model of the same size.

Both models have the same width, depth, heads, MLP hidden size and vocabulary and are
trained on the same batch with the same optimizer (AdamW) and loss (cross-entropy on
full logits), eager, in one process with the same threads. kforge's model is the one
users get on CPU/eager GPU (RMSNorm, RoPE, GELU MLP, no biases); the reference is the
smallest faithful GPT-2 (LayerNorm, learned positions, GELU MLP, fused QKV).
Runs alternate kforge / reference so machine load affects both alike; each run's
figure is its median ms per optimizer step after warm-up, and the ratio is
median(kforge) / median(reference). Target: ratio <= 1.0. Prints a table, writes
bench/results/model_speed.json.

    python bench/model_speed.py [--runs 5] [--steps 30] [--warmup 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model import Transformer
from kforge_cli.settings.training import ModelSettings

HERE = Path(__file__).resolve().parent


class RefBlock(nn.Module):
    """GPT-2 block: pre-LayerNorm, fused QKV attention through SDPA, GELU MLP."""

    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class RefGPT(nn.Module):
    """Token + learned position embeddings, blocks, final LayerNorm, untied head."""

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        hidden = cfg.resolved_ffn_hidden_dim
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(RefBlock(cfg.dim, cfg.n_heads, hidden) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def model_config(args: argparse.Namespace) -> ModelSettings:
    return ModelSettings(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        vocab_size=args.vocab,
        max_seq_len=max(args.seq, 64),
        ffn_hidden_dim=args.ffn,
        activation="gelu",
        norm="rmsnorm",
    )


def time_run(model: nn.Module, data: torch.Tensor, warmup: int) -> tuple[float, float]:
    """Median ms per optimizer step (forward, CE, backward, AdamW, zero_grad) after warm-up,
    by wall clock and by this process's CPU time (which other jobs on a shared box disturb less)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    wall: list[float] = []
    cpu: list[float] = []
    for i in range(data.shape[0]):
        x, y = data[i, :, :-1], data[i, :, 1:]
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if i >= warmup:
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results" / "model_speed.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_config(args)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (args.steps, args.batch, args.seq + 1), generator=g)
    kf: list[tuple[float, float]] = []
    ref: list[tuple[float, float]] = []
    params: dict[str, int] = {}
    for _ in range(args.runs):
        torch.manual_seed(0)
        kmodel = Transformer(cfg)
        rmodel = RefGPT(cfg)
        params = {
            "kforge": sum(p.numel() for p in kmodel.parameters()),
            "reference": sum(p.numel() for p in rmodel.parameters()),
        }
        kf.append(time_run(kmodel, data, args.warmup))
        ref.append(time_run(rmodel, data, args.warmup))
    result: dict[str, object] = {
        "shape": {k: getattr(args, k) for k in ("dim", "layers", "heads", "ffn", "vocab", "batch", "seq")},
        "threads": torch.get_num_threads(),
        "runs": args.runs,
        "steps": args.steps,
        "warmup": args.warmup,
        "params": params,
    }
    print(f"{'model':<12}{'clock':<6}{'params':>10}{'median ms/step':>16}{'min':>9}{'max':>9}")
    for i, clock in enumerate(("wall", "cpu")):
        k, r = [run[i] for run in kf], [run[i] for run in ref]
        for name, xs in (("kforge", k), ("reference", r)):
            med = statistics.median(xs)
            print(f"{name:<12}{clock:<6}{params[name]:>10,}{med:>16.2f}{min(xs):>9.2f}{max(xs):>9.2f}")
        ratio = statistics.median(k) / statistics.median(r)
        print(f"ratio kforge/reference ({clock} clock) = {ratio:.3f}  (target <= 1.0)")
        result[f"{clock}_kforge_ms"] = statistics.median(k)
        result[f"{clock}_reference_ms"] = statistics.median(r)
        result[f"{clock}_ratio"] = ratio
        result[f"{clock}_runs_ms"] = {"kforge": k, "reference": r}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
