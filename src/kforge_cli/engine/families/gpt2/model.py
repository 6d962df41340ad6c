"""A GPT-2-style decoder: learned token and position embeddings, pre-norm blocks with LayerNorm
(weight and bias), multi-head attention and a GELU MLP whose projections all have biases.

Parameter names: ``wte``, ``wpe``, ``layers.<i>.{ln_1, attn.{q_proj,k_proj,v_proj,out_proj},
ln_2, mlp.{fc,proj}}``, ``norm``, ``output`` (absent when tied to ``wte``). ``layers`` is a
``ModuleDict`` keyed by the global block index, as the family protocol asks
(``engine.families.base``), so pipeline stages, FSDP and activation checkpointing find the blocks.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model.attention_mask import AttentionMask, build_attention_mask
from kforge_cli.engine.model.block import HeadLossFn
from kforge_cli.engine.model.kv_cache import KVCache, self_attention
from kforge_cli.engine.model.sequence_shard import SequenceShard
from kforge_cli.settings.training import ModelSettings


class GPT2Attention(nn.Module):
    """Causal multi-head attention, projections with bias. Heads are recovered with
    ``view(B, T, -1, head_dim)`` so that under tensor parallelism a rank works on its heads."""

    kv_cache: KVCache | None = None  # set by KVCache.bound during a generation forward

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, mask: AttentionMask | torch.Tensor | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = (
            p(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = self_attention(q, k, v, mask, self.kv_cache, self)
        return self.out_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.resolved_ffn_hidden_dim)
        self.proj = nn.Linear(cfg.resolved_ffn_hidden_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    """``h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))``."""

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def init_weights(self, std: float, out_std: float) -> None:
        """LayerNorms to (1, 0), weights ~ N(0, std), residual outputs ~ N(0, out_std), biases 0; fixed order."""
        for module in (self.ln_1, self.attn.q_proj, self.attn.k_proj, self.attn.v_proj, self.attn.out_proj):
            _init(module, std, out_std if module is self.attn.out_proj else std)
        for module in (self.ln_2, self.mlp.fc, self.mlp.proj):
            _init(module, std, out_std if module is self.mlp.proj else std)

    def forward(self, x: torch.Tensor, mask: AttentionMask | torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x), mask)
        return h + self.mlp(self.ln_2(h))


def _init(module: nn.Module, std: float, weight_std: float) -> None:
    del std
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=weight_std)
        nn.init.zeros_(module.bias)


class GPT2(nn.Module):
    """The model; built on meta and materialised on the default device like the Llama family's
    (``torch.manual_seed(s); GPT2(cfg)`` equals the meta build, ``to_empty`` and ``init_weights``)."""

    sequence_shard: SequenceShard | None = None  # the family has no context-parallel plan: never set

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.cfg = cfg
        target = torch.get_default_device()
        with torch.device("meta"):
            self.wte: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.wpe: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, cfg.dim)
            self.layers = nn.ModuleDict({str(i): GPT2Block(cfg) for i in range(cfg.n_layers)})
            self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
            self.output: nn.Linear | None = (
                None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            )
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embeddings, blocks by index, final norm, head: a fixed order (the model has no buffers)."""
        del buffer_device
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for emb in (self.wte, self.wpe):
            if emb is not None:
                nn.init.normal_(emb.weight, mean=0.0, std=std)
        for key in sorted(self.layers.keys(), key=int):
            cast(GPT2Block, self.layers[key]).init_weights(std, out_std)
        if self.norm is not None:
            _init(self.norm, std, std)
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def head_weight(self) -> torch.Tensor | None:
        if self.output is not None:
            return self.output.weight
        if self.cfg.tie_embeddings and self.wte is not None:
            return self.wte.weight
        return None

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_fn: HeadLossFn | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits, the loss (``labels`` and ``loss_fn``), or hidden states on a non-last pipeline stage."""
        if (labels is None) != (loss_fn is None):
            raise ValueError("pass both labels and loss_fn to get a loss, or neither to get logits")
        if kv_cache is not None:
            with kv_cache.bound(self, tokens.shape[1]) as start:
                pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
                return self(tokens, positions=pos, labels=labels, loss_fn=loss_fn)
        if self.wte is not None and self.wpe is not None:
            if positions is None:
                if tokens.shape[1] > self.cfg.max_seq_len:
                    raise ValueError(
                        f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}"
                    )
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.wte(tokens) + self.wpe(positions)
        else:
            h = tokens
        q_len = h.shape[1] if positions is None else positions.shape[-1]
        mask = build_attention_mask(self.cfg.attention, (h.shape[0], q_len), h.device, doc_ids, None)
        for block in self.layers.values():
            h = block(h, mask)
        if self.norm is None:
            return h
        h = self.norm(h)
        weight = self.head_weight()
        if weight is None:
            return h
        if loss_fn is not None and labels is not None:
            return loss_fn(h, weight, labels)
        return self.output(h) if self.output is not None else F.linear(h, weight)
