"""The Gemma 3 family's model (text): a decoder whose blocks alternate local (sliding-window) and
global attention, each with its own RoPE base, QK-norm, a norm before *and* after each sub-block,
a GeGLU MLP, embeddings scaled by ``sqrt(dim)``, the head tied to the embedding, and optional
final logit soft-capping. Computes what transformers' ``Gemma3ForCausalLM`` computes.

Gemma's RMSNorm scales by ``1 + weight`` (weights start at zero), in fp32, cast back after the
scaling. Parameter names (the checkpoint contract): ``tok_embeddings``, ``layers.<i>.{attention_norm,
attention.{wq,wk,wv,wo,q_norm,k_norm}, post_attention_norm, ffn_norm, feed_forward.{w1,w2,w3},
post_ffn_norm}``, ``norm``, ``output`` (absent when tied). ``layers`` is a ``ModuleDict`` keyed by
the global block index (``engine.families.base``).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.engine.model.attention import residual_std
from kforge_cli.engine.model.attention_mask import AttentionMask, build_attention_mask
from kforge_cli.engine.model.block import HeadLossFn
from kforge_cli.engine.model.kv_cache import KVCache, self_attention
from kforge_cli.engine.model.layers import apply_rotary_pair, rope_tables
from kforge_cli.engine.model.sequence_shard import SequenceShard
from kforge_cli.settings.gemma3 import Gemma3Settings
from kforge_cli.settings.training import ModelSettings


def gemma_settings(cfg: ModelSettings) -> Gemma3Settings:
    return cfg.gemma3 if cfg.gemma3 is not None else Gemma3Settings()


def global_rope_tables(
    head_dim: int, max_seq_len: int, theta: float, factor: float, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of the global layers: :func:`rope_tables` with linear scaling (the inverse
    frequencies divided by ``factor``, as transformers' ``linear`` rope type computes them)."""
    if factor == 1.0:
        return rope_tables(head_dim, max_seq_len, theta, device)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    inv_freq = inv_freq / factor
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in fp32, cast back to the input's dtype; weight starts at zero."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class GemmaAttention(nn.Module):
    """Grouped-query attention with QK-norm, RoPE (the block's base) and the softmax scale
    ``query_pre_attn_scalar ** -0.5``; local or global per the mask it is given. Heads are
    recovered with ``view(B, T, -1, head_dim)`` so each TP rank works on its own heads."""

    kv_cache: KVCache | None = None  # set by KVCache.bound during a generation forward

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        g = gemma_settings(cfg)
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.scale = float(g.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.wq = nn.Linear(cfg.dim, q_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=False)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | torch.Tensor | None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rotary_pair(q, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self_attention(q, k, v, mask, self.kv_cache, self, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class GemmaMLP(nn.Module):
    """GeGLU: ``w2(gelu_tanh(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        hidden = cfg.resolved_ffn_hidden_dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class GemmaBlock(nn.Module):
    """``h = x + post_attn(attn(norm(x))); out = h + post_ffn(mlp(norm(h)))``; ``is_global``: which
    RoPE table and mask the model hands it."""

    def __init__(self, cfg: ModelSettings, layer_id: int) -> None:
        super().__init__()
        self.is_global = gemma_settings(cfg).is_global(layer_id)
        self.attention_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = GemmaAttention(cfg)
        self.post_attention_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = GemmaMLP(cfg)
        self.post_ffn_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.post_attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(std, out_std)
        self.post_ffn_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, mask))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Gemma3Transformer(nn.Module):
    """The model; built on meta and materialised on the default device like the Llama family's
    (``torch.manual_seed(s); Gemma3Transformer(cfg)`` equals the meta build, ``to_empty`` and
    ``init_weights``). ``rope_cos``/``rope_sin`` rotate the global layers (``model.rope_theta``),
    ``rope_local_cos``/``rope_local_sin`` the local ones (``model.gemma3.rope_local_theta``)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_local_cos: torch.Tensor
    rope_local_sin: torch.Tensor
    sequence_shard: SequenceShard | None = None  # set by the parallel builder under context parallelism

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.cfg = cfg
        target = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleDict({str(i): GemmaBlock(cfg, i) for i in range(cfg.n_layers)})
            self.norm: GemmaRMSNorm | None = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
            self.output: nn.Linear | None = (
                None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            )
        for name, table in self.rope_buffers(torch.device("meta")).items():
            self.register_buffer(name, table, persistent=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    def rope_buffers(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The fp32 RoPE tables of both layer kinds on ``device`` (derived from the config)."""
        g = gemma_settings(self.cfg)
        cos, sin = global_rope_tables(
            self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, g.rope_linear_factor, device
        )
        lcos, lsin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, g.rope_local_theta, device)
        return {"rope_cos": cos, "rope_sin": sin, "rope_local_cos": lcos, "rope_local_sin": lsin}

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """RoPE tables, embedding, blocks by index, final norm, head: a fixed order. Projections
        ~ N(0, init_std), residual outputs ~ N(0, init_std / sqrt(2 n_layers)), norms to zero (scale one)."""
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        for name, table in self.rope_buffers(device).items():
            setattr(self, name, table)
        std, out_std = self.cfg.init_std, residual_std(self.cfg)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for key in sorted(self.layers.keys(), key=int):
            cast(GemmaBlock, self.layers[key]).init_weights(std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def head_weight(self) -> torch.Tensor | None:
        if self.output is not None:
            return self.output.weight
        if self.cfg.tie_embeddings and self.tok_embeddings is not None:
            return self.tok_embeddings.weight
        return None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings times ``sqrt(dim)`` rounded to the embedding's dtype (as transformers does)."""
        assert self.tok_embeddings is not None
        h = self.tok_embeddings(tokens)
        scale = float(torch.tensor(math.sqrt(self.cfg.dim), dtype=self.tok_embeddings.weight.dtype))
        return h * scale

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
        """Logits ``[B, T, vocab]``, the loss (``labels`` and ``loss_fn``), or hidden states on a
        non-last pipeline stage; arguments as the Llama family's ``Transformer.forward``."""
        if (labels is None) != (loss_fn is None):
            raise ValueError("pass both labels and loss_fn to get a loss, or neither to get logits")
        if self.cfg.gemma3 is not None and self.cfg.gemma3.final_logit_softcapping is not None and loss_fn is not None:
            raise ValueError("final logit soft-capping computes logits: train with the full-logits loss")
        if kv_cache is not None:
            if doc_ids is not None or positions is not None:
                raise ValueError("KV-cache decoding takes no doc_ids or positions (they follow the cache)")
            with kv_cache.bound(self, tokens.shape[1]) as start:
                pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
                return self(tokens, positions=pos, labels=labels, loss_fn=loss_fn)
        h = self.embed(tokens) if self.tok_embeddings is not None else tokens
        seqlen = h.shape[1]
        tables = (self.rope_cos, self.rope_sin, self.rope_local_cos, self.rope_local_sin)
        if positions is None:
            if self.sequence_shard is not None:
                raise ValueError("a context-parallel shard needs its global positions (shard the batch first)")
            if seqlen > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seqlen} exceeds model.max_seq_len={self.cfg.max_seq_len}")
            cos, sin, lcos, lsin = (t[:seqlen] for t in tables)
        else:
            cos, sin, lcos, lsin = (t[positions] for t in tables)
        q_len = seqlen if positions is None else positions.shape[-1]
        shape, backend, shard = (h.shape[0], q_len), self.cfg.attention, self.sequence_shard
        g = gemma_settings(self.cfg)
        blocks = [cast(GemmaBlock, b) for b in self.layers.values()]
        global_mask = local_mask = None
        if any(b.is_global for b in blocks):
            global_mask = build_attention_mask(backend, shape, h.device, doc_ids, shard)
        if not all(b.is_global for b in blocks):
            local_mask = build_attention_mask(backend, shape, h.device, doc_ids, shard, window=g.sliding_window)
        for block in blocks:
            if block.is_global:
                h = block(h, cos, sin, global_mask)
            else:
                h = block(h, lcos, lsin, local_mask)
        if self.norm is None:
            return h
        h = self.norm(h)
        weight = self.head_weight()
        if weight is None:
            return h
        if loss_fn is not None and labels is not None:
            return loss_fn(h, weight, labels)
        logits = self.output(h) if self.output is not None else F.linear(h, weight)
        cap = g.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


__all__ = ["Gemma3Transformer", "GemmaAttention", "GemmaBlock", "GemmaMLP", "GemmaRMSNorm"]
