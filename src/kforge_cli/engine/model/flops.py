"""Parameter and training-FLOP counts, for logging and MFU.

Convention (PaLM appendix B, as used by torchtitan): training one token costs

    6 * N + 12 * n_layers * n_heads * head_dim * seq_len

FLOPs, where ``N`` is the number of parameters *excluding the token-embedding
table* (a lookup, not a matmul) but *including the output head* (a real matmul,
counted once even when tied to the embedding). ``6 = 2`` (multiply-add) ``x 3``
(forward + two backward matmuls). The second term is the attention score and
value matmuls (``QK^T`` and ``AV``), counted over the full ``seq_len`` without
halving for causality, as PaLM does. Activation checkpointing recompute is not
counted: MFU measures useful model FLOPs.
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
    """``N`` of the FLOP formula: all parameters except the token-embedding table.

    The output head (``vocab * dim``) is included, once, tied or not.
    """
    return cfg.non_embedding_params()


def flops_per_token(cfg: ModelSettings, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) at sequence length ``seq_len``."""
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return float(6 * non_embedding_params(cfg) + attention)
