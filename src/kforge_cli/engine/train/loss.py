"""Cross-entropy (+ optional z-loss) as a SUM over valid tokens, plain or chunked.

Why a sum and not a mean: with gradient accumulation, several ranks and document
masking, each micro-batch holds a different number of valid tokens. Averaging per
micro-batch would weight tokens unequally. The training step therefore sums the loss
of every micro-batch and divides once by the number of valid tokens of the WHOLE step
(all micro-batches, all data-parallel ranks). Every function here returns the sum;
**the caller normalises**.

Why chunked: the logits of a step are ``B*T x V`` floats (e.g. 8k tokens x 128k vocab
x 4 bytes = 4 GiB in fp32). :func:`chunked_cross_entropy_sum` projects ``chunk_size``
tokens at a time and wraps each chunk in activation checkpointing, so neither the
forward nor the backward ever holds more than one chunk's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.settings import JobSettings


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0) -> torch.Tensor:
    """CE + ``z_loss_weight * logsumexp(logits)**2`` per position (0 where ``label == IGNORE_INDEX``).

    ``logits`` is ``[..., V]`` and ``labels`` is ``[...]``; the result has the shape of
    ``labels``. The computation is done in fp32 whatever the logits dtype (bf16
    log-softmax loses too much precision over a large vocabulary). The log-partition
    ``logsumexp`` is computed once and shared by the CE (``lse - logit[label]``) and the
    z-loss (``lse**2``, which keeps the logits from drifting, as in PaLM).
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab).float()
    flat_labels = labels.reshape(-1)
    if flat_labels.shape[0] != flat_logits.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)} (expected [..., V])")
    valid = flat_labels != IGNORE_INDEX
    lse = torch.logsumexp(flat_logits, dim=-1)
    safe_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
    target_logit = flat_logits.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    per_token = lse - target_logit
    if z_loss_weight:
        per_token = per_token + z_loss_weight * lse.square()
    return torch.where(valid, per_token, torch.zeros_like(per_token)).view(labels.shape)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0) -> torch.Tensor:
    """Sum over positions with ``label != IGNORE_INDEX`` of :func:`cross_entropy_per_token`."""
    return cross_entropy_per_token(logits, labels, z_loss_weight).sum()


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss_weight: float) -> torch.Tensor:
    """Project one chunk of hidden states to logits and return its per-token losses."""
    return cross_entropy_per_token(hidden @ weight.t(), labels, z_loss_weight)


def chunked_cross_entropy_per_token(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    z_loss_weight: float = 0.0,
) -> torch.Tensor:
    """:func:`cross_entropy_per_token` of ``hidden @ weight.T`` without materialising all logits.

    ``hidden`` is ``[B, T, D]`` (or any ``[..., D]``), ``weight`` the head ``[V, D]`` and
    ``labels`` ``[B, T]``. Tokens are processed ``chunk_size`` at a time; each chunk runs
    under non-reentrant activation checkpointing, so its logits are freed right after its
    forward and recomputed, one chunk at a time, during the backward. The values and the
    gradients equal those of the plain path (up to float summation order); only the
    per-token losses (one float per token) are kept.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    dim = hidden.shape[-1]
    flat_hidden = hidden.reshape(-1, dim)
    flat_labels = labels.reshape(-1)
    if flat_labels.shape[0] != flat_hidden.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    # split (not slicing) so the backward concatenates the chunk gradients once.
    parts = [
        checkpoint(_chunk_loss, h, weight, lab, z_loss_weight, use_reentrant=False)
        for h, lab in zip(flat_hidden.split(chunk_size), flat_labels.split(chunk_size), strict=True)
    ]
    if not parts:  # zero tokens: an empty result that still depends on the inputs
        return (flat_hidden.sum() * 0.0 + weight.sum() * 0.0).float().expand(labels.shape)
    return torch.cat(parts).view(labels.shape)


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    z_loss_weight: float = 0.0,
) -> torch.Tensor:
    """The sum of :func:`chunked_cross_entropy_per_token` (equals :func:`cross_entropy_sum`)."""
    return chunked_cross_entropy_per_token(hidden, weight, labels, chunk_size, z_loss_weight).sum()


def count_valid_tokens(labels: torch.Tensor) -> int:
    """Number of positions that contribute to the loss (``label != IGNORE_INDEX``)."""
    return int((labels != IGNORE_INDEX).sum().item())


class LossFn:
    """The training loss, configured once from the settings.

    ``loss_fn(hidden, weight, labels)`` is what the model calls with its final-norm
    output and its head weight; :meth:`from_logits` is the path for models (or stages)
    that produce logits themselves. Both return the SUM over valid tokens: the training
    step divides by the number of valid tokens of all micro-batches on all ranks.
    """

    def __init__(self, chunk_size: int = 0, z_loss_weight: float = 0.0) -> None:
        if chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
        self.chunk_size = chunk_size
        self.z_loss_weight = z_loss_weight

    @property
    def chunked(self) -> bool:
        """True when the head projection is computed chunk by chunk (train.loss_chunk_size > 0)."""
        return self.chunk_size > 0

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss sum of ``hidden @ weight.T`` (chunked when configured, else one projection)."""
        return self.per_token(hidden, weight, labels).sum()

    def from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss sum of precomputed logits ``[..., V]``."""
        return self.per_token_from_logits(logits, labels).sum()

    def per_token(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Like ``__call__`` but per position (shape of ``labels``), for per-dataset losses."""
        if self.chunked:
            return chunked_cross_entropy_per_token(hidden, weight, labels, self.chunk_size, self.z_loss_weight)
        return cross_entropy_per_token(F.linear(hidden, weight), labels, self.z_loss_weight)

    def per_token_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Like :meth:`from_logits` but per position."""
        return cross_entropy_per_token(logits, labels, self.z_loss_weight)

    def __repr__(self) -> str:
        return f"LossFn(chunk_size={self.chunk_size}, z_loss_weight={self.z_loss_weight})"


def build_loss_fn(settings: JobSettings) -> LossFn:
    """The loss of a job: ``train.loss_chunk_size`` and ``train.z_loss_weight``."""
    return LossFn(chunk_size=settings.train.loss_chunk_size, z_loss_weight=settings.train.z_loss_weight)
