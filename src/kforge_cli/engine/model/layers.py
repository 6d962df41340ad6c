"""Normalisation layers and rotary position embeddings (RoPE).

RoPE is kept real-valued (cos/sin tables, no complex numbers) so it composes with
DTensor tensor parallelism, and follows the Hugging Face Llama "rotate_half"
convention (dimension ``i`` is paired with ``i + head_dim/2``) so exporting to
Hugging Face needs no permutation of the q/k projection weights.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

NormKind = Literal["rmsnorm", "layernorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias).

    Computed in fp32 and cast back: under bf16 the mean of squares loses enough
    precision to hurt training stability.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Scale of one: the identity map at initialisation."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def build_norm(kind: NormKind, dim: int, eps: float) -> nn.Module:
    """The norm named by ``model.norm``: both variants hold a single ``weight`` (no bias)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    raise ValueError(f"unknown norm {kind!r}; expected 'rmsnorm' or 'layernorm'")


def reset_norm(norm: nn.Module) -> None:
    """Reset a norm built by :func:`build_norm` to weight = 1."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        nn.init.ones_(weight)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` tables of shape ``[max_seq_len, head_dim]`` (HF Llama layout).

    Frequency ``j`` (of ``head_dim/2``) is ``theta ** (-2j / head_dim)`` and is
    repeated for both halves of the head, matching :func:`rotate_half`.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, T, H, head_dim]`` by position.

    ``cos``/``sin`` are ``[B, T, head_dim]`` (per-token positions) or ``[T, head_dim]``.
    The rotation runs in fp32 (angles of long positions need it) and is cast back.
    """
    cos = cos.unsqueeze(-2)  # broadcast over heads
    sin = sin.unsqueeze(-2)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def apply_rotary_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` of queries and keys at the same positions."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
