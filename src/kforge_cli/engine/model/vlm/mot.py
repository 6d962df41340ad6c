"""Mixture-of-Transformers (MoT) block: per-modality weights, one global self-attention.

Each block holds one dense-shaped expert per modality, ``experts.<modality>``, with
exactly the submodules (and parameter names) of a text ``TransformerBlock``:
``attention_norm``, ``attention.{wq, wk, wv, wo, q_norm, k_norm}``, ``ffn_norm``,
``feed_forward.{w1, w2, w3}``. A token's modality id picks the expert whose norms,
Q/K/V/O projections and MLP process it; attention itself runs once over *all* tokens
(causal, RoPE over the joint positions). So the dense parameter
``layers.<i>.attention.wq.weight`` becomes ``layers.<i>.experts.<m>.attention.wq.weight``
for every modality ``m``, which is all `kforge convert-mot` has to know. With only
text tokens, a MoT block computes exactly what the dense block with the text expert's
weights computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kforge_cli.engine.model.block import TransformerBlock
from kforge_cli.engine.model.kv_cache import KVCache, self_attention
from kforge_cli.engine.model.layers import apply_rotary_pair
from kforge_cli.settings.training import ModelSettings

Route = tuple[str, torch.Tensor | None]
"""(modality, flat token indices into ``B*T``); ``None`` = every token has this modality."""


def build_routes(modality_ids: torch.Tensor, modalities: Sequence[str]) -> list[Route]:
    """The routes of a ``[B, T]`` modality-id tensor (ids index ``modalities``); absent modalities are left out."""
    flat = modality_ids.reshape(-1)
    routes: list[Route] = []
    for m, name in enumerate(modalities):
        hit = flat == m
        count = int(hit.sum())
        if count == flat.numel():
            return [(name, None)]
        if count:
            routes.append((name, hit.nonzero().squeeze(1)))
    return routes


def _per_route(
    flat: torch.Tensor, routes: Sequence[Route], width: int, experts: dict[str, nn.Module], op: str
) -> torch.Tensor:
    """Apply each route's expert submodule ``op`` to its tokens of ``flat`` ``[N, D]`` -> ``[N, width]``."""
    out: torch.Tensor | None = None
    for name, idx in routes:
        module = experts[name].get_submodule(op)
        if idx is None:
            return module(flat)
        part = module(flat.index_select(0, idx))
        if out is None:
            out = flat.new_zeros(flat.shape[0], width, dtype=part.dtype)
        out = out.index_copy(0, idx, part)
    assert out is not None, "no tokens were routed"
    return out


class MoTBlock(nn.Module):
    """One MoT layer; see the module docstring for names and semantics.

    ``kv_cache`` is bound only during a generation forward (text-only decoding).
    """

    kv_cache: KVCache | None = None

    def __init__(self, cfg: ModelSettings, modalities: Sequence[str]) -> None:
        super().__init__()
        self.modalities = tuple(modalities)
        self.head_dim = cfg.head_dim
        self.q_dim = cfg.n_heads * cfg.head_dim
        self.kv_dim = cfg.kv_heads * cfg.head_dim
        self.dim = cfg.dim
        self.qk_norm = cfg.qk_norm
        self.experts = nn.ModuleDict({m: TransformerBlock(cfg) for m in self.modalities})

    def init_weights(self, std: float, out_std: float) -> None:
        """Each expert as a dense block, in modality order."""
        for m in self.modalities:
            expert = self.experts[m]
            assert isinstance(expert, TransformerBlock)
            expert.init_weights(std, out_std)

    def _qkv(self, flat: torch.Tensor, routes: Sequence[Route]) -> tuple[torch.Tensor, ...]:
        experts = dict(self.experts.items())
        normed = _per_route(flat, routes, self.dim, experts, "attention_norm")
        q = _per_route(normed, routes, self.q_dim, experts, "attention.wq")
        k = _per_route(normed, routes, self.kv_dim, experts, "attention.wk")
        v = _per_route(normed, routes, self.kv_dim, experts, "attention.wv")
        if self.qk_norm:
            q = _per_route(
                q.view(-1, self.head_dim),
                _head_routes(routes, self.q_dim // self.head_dim),
                self.head_dim,
                experts,
                "attention.q_norm",
            ).view(q.shape)
            k = _per_route(
                k.view(-1, self.head_dim),
                _head_routes(routes, self.kv_dim // self.head_dim),
                self.head_dim,
                experts,
                "attention.k_norm",
            ).view(k.shape)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        routes: Sequence[Route] = (("text", None),),
    ) -> torch.Tensor:
        """``x`` ``[B, T, D]``; ``routes`` from :func:`build_routes`; causal, or ``mask`` (True = attend)."""
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        q, k, v = self._qkv(flat, routes)
        q, k = apply_rotary_pair(
            q.view(bsz, seqlen, -1, self.head_dim), k.view(bsz, seqlen, -1, self.head_dim), cos, sin
        )
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        att = self_attention(q, k, v, mask, self.kv_cache, self)
        experts = dict(self.experts.items())
        att = att.transpose(1, 2).reshape(-1, self.q_dim)
        h = x + _per_route(att, routes, dim, experts, "attention.wo").view(bsz, seqlen, dim)
        normed = _per_route(h.reshape(-1, dim), routes, dim, experts, "ffn_norm")
        return h + _per_route(normed, routes, dim, experts, "feed_forward").view(bsz, seqlen, dim)  # not a view


def _head_routes(routes: Sequence[Route], heads: int) -> list[Route]:
    """Token routes expanded to per-head rows (QK-norm acts on ``[B*T*heads, head_dim]``)."""
    out: list[Route] = []
    for name, idx in routes:
        if idx is None:
            out.append((name, None))
        else:
            rows = idx.unsqueeze(1) * heads + torch.arange(heads, device=idx.device)
            out.append((name, rows.reshape(-1)))
    return out
