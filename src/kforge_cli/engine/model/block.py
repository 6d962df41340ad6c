"""The pre-norm decoder block of the Llama family, shared by the VLM architectures built around it.

Parameter names are a checkpoint contract (DCP keys, HF export, MoT conversion):
``attention_norm``, ``attention.{wq,wk,wv,wo,q_norm,k_norm}``, ``ffn_norm``,
``feed_forward.{w1,w2,w3}`` (or an MoE feed-forward). The family that assembles these blocks
into a model (``engine/families/llama``) owns what parallelism and export do with the names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kforge_cli.engine.model.attention import Attention, residual_std
from kforge_cli.engine.model.attention_mask import AttentionMask
from kforge_cli.engine.model.layers import build_norm, reset_norm, rope_tables
from kforge_cli.engine.model.mlp import FeedForward
from kforge_cli.engine.model.moe.layer import MoEFeedForward
from kforge_cli.settings.training import ModelSettings

HeadLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(hidden [B, T, D], head_weight [V, D], labels [B, T]) -> loss``."""


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelSettings, layer_id: int = 0) -> None:
        super().__init__()
        self.attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(layer_id)
        self.feed_forward: FeedForward | MoEFeedForward = MoEFeedForward(cfg) if moe else FeedForward(cfg)

    def init_weights(self, std: float, out_std: float) -> None:
        """Norms to one, projections ~ N(0, std), residual outputs ~ N(0, out_std); fixed order."""
        reset_norm(self.attention_norm)
        self.attention.init_weights(std, out_std)
        reset_norm(self.ffn_norm)
        self.feed_forward.init_weights(std, out_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask | torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def init_decoder_weights(model: Any, device: torch.device) -> None:
    """Re-initialise a decoder's text parts in a fixed order: RoPE tables, embedding, blocks by
    index, final norm, head. Shared by the text Transformer and the VLM language model, which
    use the same attribute names (``cfg``, ``tok_embeddings``, ``layers``, ``norm``, ``output``)."""
    cfg = model.cfg
    model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device)
    std, out_std = cfg.init_std, residual_std(cfg)
    if model.tok_embeddings is not None:
        nn.init.normal_(model.tok_embeddings.weight, mean=0.0, std=std)
    for key in sorted(model.layers.keys(), key=int):
        model.layers[key].init_weights(std, out_std)
    if model.norm is not None:
        reset_norm(model.norm)
    if model.output is not None:
        nn.init.normal_(model.output.weight, mean=0.0, std=std)


def decoder_head_weight(model: Any) -> torch.Tensor | None:
    """The decoder's ``[vocab, dim]`` head weight (the embedding when tied; None without a head)."""
    if model.output is not None:
        return model.output.weight
    if model.cfg.tie_embeddings and model.tok_embeddings is not None:
        return model.tok_embeddings.weight
    return None
