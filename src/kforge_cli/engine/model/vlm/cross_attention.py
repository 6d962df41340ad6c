"""Cross-attention decoder layers: a text-only residual stream that reads visual tokens.

Every ``vlm.cross_attention_every``-th layer (layer indices 0, k, 2k, ...) gets a
pre-norm cross-attention sub-block *before* its usual self-attention and MLP:
``x = x + xattn(cross_attention_norm(x), visual)``. Its output projection starts at
zero, so at initialisation the model computes exactly the text model's function and
the image pathway is learned from there (the Flamingo / Llama-3.2-Vision recipe).
The text parameters keep the dense names (``layers.<i>.attention.wq`` ...); the new
ones are ``layers.<i>.cross_attention.{wq, wk, wv, wo}`` and
``layers.<i>.cross_attention_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model.block import TransformerBlock
from kforge_cli.engine.model.layers import build_norm, reset_norm
from kforge_cli.settings.training import ModelSettings


class CrossAttention(nn.Module):
    """Text queries attend to visual keys/values (no RoPE, no causality; padded frames masked)."""

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        inner = cfg.n_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, inner, bias=False)
        self.wk = nn.Linear(cfg.dim, inner, bias=False)
        self.wv = nn.Linear(cfg.dim, inner, bias=False)
        self.wo = nn.Linear(inner, cfg.dim, bias=False)

    def init_weights(self, std: float) -> None:
        """Q/K/V ~ N(0, std); the output projection is zero (the block starts as the identity)."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.zeros_(self.wo.weight)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` ``[B, L, D]`` attends to ``memory`` ``[B, S, D]``; ``memory_mask`` ``[B, S]`` (True = real)."""
        bsz, length, _ = x.shape
        q = self.wq(x).view(bsz, length, -1, self.head_dim).transpose(1, 2)
        k = self.wk(memory).view(bsz, memory.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.wv(memory).view(bsz, memory.shape[1], -1, self.head_dim).transpose(1, 2)
        mask = memory_mask[:, None, None, :] if memory_mask is not None else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, length, -1))


class CrossAttentionDecoderLayer(TransformerBlock):
    """A dense text block, optionally preceded by a gated-by-zero-init cross-attention sub-block."""

    def __init__(self, cfg: ModelSettings, with_cross_attention: bool) -> None:
        super().__init__(cfg)
        self.cross_attention_norm: nn.Module | None = None
        self.cross_attention: CrossAttention | None = None
        if with_cross_attention:
            self.cross_attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
            self.cross_attention = CrossAttention(cfg)

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        if self.cross_attention is not None and self.cross_attention_norm is not None:
            reset_norm(self.cross_attention_norm)
            self.cross_attention.init_weights(std)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.cross_attention is not None and self.cross_attention_norm is not None and memory is not None:
            x = x + self.cross_attention(self.cross_attention_norm(x), memory, memory_mask)
        return super().forward(x, cos, sin, mask)
