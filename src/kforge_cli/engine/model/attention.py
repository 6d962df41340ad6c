"""Causal grouped-query self-attention; the kernel (SDPA or FlexAttention) is chosen per batch
by the mask it is given (see :mod:`kforge_cli.engine.model.attention_mask`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from kforge_cli.engine.model.attention_mask import AttentionMask
from kforge_cli.engine.model.kv_cache import KVCache, self_attention
from kforge_cli.engine.model.layers import apply_rotary_pair, build_norm, reset_norm
from kforge_cli.settings.training import ModelSettings


class Attention(nn.Module):
    """Multi-head / grouped-query attention with RoPE and optional QK-norm.

    Heads are recovered with ``view(B, T, -1, head_dim)`` rather than the configured
    head count so that, under tensor parallelism, each rank works on its local
    slice of heads without knowing the TP degree. ``kv_cache`` is set only while a
    generation forward runs (:meth:`KVCache.bound`); training leaves it None.
    """

    kv_cache: KVCache | None = None

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        q_dim = self.n_heads * self.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(cfg.dim, q_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=False)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm:
            self.q_norm = build_norm(cfg.norm, self.head_dim, cfg.norm_eps)
            self.k_norm = build_norm(cfg.norm, self.head_dim, cfg.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        """Projections ~ N(0, std); the residual output projection ~ N(0, out_std)."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                reset_norm(norm)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[B, T, D]`` -> ``[B, T, D]``; causal, or per ``mask`` (an AttentionMask, or bool: True = attend)."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rotary_pair(q, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        out = self_attention(q, k, v, mask, self.kv_cache, self)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


def residual_std(cfg: ModelSettings) -> float:
    """Std of residual output projections: init_std / sqrt(2 * n_layers) (GPT-2 style).

    Each block adds two projections to the residual stream; scaling them keeps the
    stream's variance independent of depth at initialisation.
    """
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)
