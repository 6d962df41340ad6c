"""Parameter and training-FLOP counts, for logging and MFU.

Convention (PaLM appendix B, as used by torchtitan): training one token costs

    6 * N + 12 * n_layers * n_heads * head_dim * seq_len

FLOPs, where ``N`` is the number of parameters *excluding the token-embedding
table* (a lookup, not a matmul) but *including the output head* (a real matmul,
counted once even when tied to the embedding). ``6 = 2`` (multiply-add) ``x 3``
(forward + two backward matmuls). The second term is the attention score and
value matmuls (``QK^T`` and ``AV``), counted over the full ``seq_len`` without
halving for causality, as PaLM does. Activation checkpointing recompute is not
counted: MFU measures useful model FLOPs. For Mixture-of-Experts models ``N`` counts
the *active* parameters (router, shared experts and top_k of the routed experts per
MoE layer), the work one token really does; dropped tokens are not subtracted.
"""

from __future__ import annotations

from torch import nn

from kforge_cli.settings.training import ModelSettings


def count_params(model: nn.Module) -> int:
    """Number of parameters of ``model`` (tied ones once).

    For DTensor parameters (FSDP2/TP) ``numel()`` is already the global size, so
    this gives the full model's count on every rank.
    """
    return sum(p.numel() for p in model.parameters())


def non_embedding_params(cfg: ModelSettings) -> int:
    """``N`` of the FLOP formula: all *active* parameters except the token-embedding table.

    The output head (``vocab * dim``) is included, once, tied or not; an MoE layer
    counts its router, shared experts and ``top_k`` routed experts.
    """
    return cfg.non_embedding_params()


def decoder_flops_per_token(non_embedding: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """The convention above from its parts: ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len``.

    A family's ``flops_per_token`` calls it with its own ``N`` (``engine.families.base``).
    """
    return float(6 * non_embedding + 12 * n_layers * n_heads * head_dim * seq_len)


def flops_per_token(cfg: ModelSettings, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) at sequence length ``seq_len`` of a Llama-family
    shape (``cfg.non_embedding_params()``); MFU and the planner ask the model's family instead."""
    return decoder_flops_per_token(non_embedding_params(cfg), cfg.n_layers, cfg.n_heads, cfg.head_dim, seq_len)
