"""A new model family: a GPT-2-style decoder (learned positions, LayerNorm, GELU), trained by kforge.

kforge's loop, data, loss, optimizer, checkpoints and trackers work with any model that

- keeps its blocks in ``model.layers`` (a ``ModuleDict`` or ``ModuleList``: the units that
  FSDP2 shards one by one),
- is built on the meta device and initialised by ``init_weights()`` after ``to_empty``,
- maps ``model(input_ids, **batch_extras)`` to logits ``[batch, seq, vocab]``.

Swap it in with the recipe's model phase: ``run_training(settings, model=build_gpt2_like)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.parallel import compute_dtype
from kforge_cli.engine.parallel.fsdp import apply_fsdp


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT2Like(nn.Module):
    def __init__(self, cfg: Any) -> None:  # the [model] section: dim, n_layers, n_heads, vocab_size, ...
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg.dim, cfg.n_heads) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor, **_: Any) -> torch.Tensor:  # doc_ids, positions: not used
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


def build_gpt2_like(settings: Any, runtime: Any) -> tuple[nn.Module, None]:
    """The recipe's model phase: (settings, runtime) -> (model, pipeline bundle or None)."""
    with torch.device("meta"):
        model = GPT2Like(settings.model)
    if runtime.world_size > 1:  # FSDP2 over the data-parallel ranks: each block, then the root
        dtype = compute_dtype(settings, runtime.device)
        apply_fsdp(model, runtime.fsdp_mesh(), param_dtype=dtype, reshard_after_forward=True)
    model.to_empty(device=runtime.device)
    model.init_weights()
    return model.train(), None
