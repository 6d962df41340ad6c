"""Causal grouped-query self-attention; the kernel (SDPA or FlexAttention) is chosen per batch
by the mask it is given (see :mod:`kforge_cli.engine.model.attention_mask`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model.attention_mask import AttentionMask
from kforge_cli.engine.model.kv_cache import KVCache, self_attention
from kforge_cli.engine.model.layers import apply_rotary, build_norm, reset_norm
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

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(wq x, wk x, wv x)``; as one matmul over the concatenated weights when all three are
        plain ``nn.Linear`` s holding plain tensors (one GEMM and one input-gradient GEMM instead
        of three each plus two adds: the same numbers up to float rounding). Tensor-parallel
        (DTensor) and float8 projections keep their own modules, which shard or cast them."""
        linears = (self.wq, self.wk, self.wv)
        if all(type(m) is nn.Linear and type(m.weight) in (torch.Tensor, nn.Parameter) for m in linears):
            sizes = [m.weight.shape[0] for m in linears]
            fused = F.linear(x, torch.cat([m.weight for m in linears]))
            q, k, v = fused.split(sizes, dim=-1)
            return q, k, v
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[B, T, D]`` -> ``[B, T, D]``; causal, or per ``mask`` (an AttentionMask, or bool: True = attend)."""
        bsz, seqlen, _ = x.shape
        q, k, v = (t.view(bsz, seqlen, -1, self.head_dim) for t in self.project_qkv(x))
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin).transpose(1, 2)  # [B, H, T, hd]
        k = apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        out = self_attention(q, k, v, mask, self.kv_cache, self)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


def residual_std(cfg: ModelSettings) -> float:
    """Std of residual output projections: init_std / sqrt(2 * n_layers) (GPT-2 style).

    Each block adds two projections to the residual stream; scaling them keeps the
    stream's variance independent of depth at initialisation.
    """
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)
