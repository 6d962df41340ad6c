"""Normalisation layers and rotary position embeddings (RoPE).

RoPE is kept real-valued (cos/sin tables, no complex numbers) so it composes with
DTensor tensor parallelism, and follows the Hugging Face Llama "rotate_half"
convention (dimension ``i`` is paired with ``i + head_dim/2``) so exporting to
Hugging Face needs no permutation of the q/k projection weights.

Eager speed: on CPU ``F.rms_norm`` is a composite of six autograd nodes whose backward
is several times slower than the closed-form gradient, and ``rotate_half`` costs a
``neg`` and a ``cat`` per call. In eager mode both therefore run as small
``autograd.Function`` s with hand-written backwards (:class:`_RMSNormFn`,
:class:`_RotaryFn`); under ``torch.compile`` and for DTensor inputs the plain
formulations are used, which the compiler fuses and DTensor knows how to shard.
Both give the same numbers up to float rounding.
"""

from __future__ import annotations

from typing import Any, Literal

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
        if x.device.type == "cpu" and _eager_plain(x, self.weight):
            return _RMSNormFn.apply(x, self.weight, self.eps)  # type: ignore[no-any-return]
        return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def _eager_plain(*tensors: torch.Tensor) -> bool:
    """True outside ``torch.compile`` when every tensor is a plain (non-DTensor) tensor."""
    if torch.compiler.is_compiling():
        return False
    return all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm over the last dim in fp32 with the closed-form backward.

    Saves the input (in its own dtype) and the fp32 ``rstd``; the backward is
    ``rstd * (g w - xhat * mean(g w xhat))`` and ``sum(g xhat)`` for the weight.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        mean_sq = torch.linalg.vecdot(xf, xf, dim=-1).unsqueeze(-1).div_(x.shape[-1])
        rstd = mean_sq.add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).mul_(weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        grad_weight = (g * xhat).flatten(0, -2).sum(0)
        gw = g * weight.float()
        dot = torch.linalg.vecdot(gw, xhat, dim=-1).unsqueeze(-1).div_(x.shape[-1])
        grad_x = gw.sub_(xhat.mul_(dot)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


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
    if _eager_plain(x, cos, sin):
        return _RotaryFn.apply(x, cos, sin)  # type: ignore[no-any-return]
    cos = cos.unsqueeze(-2)  # broadcast over heads
    sin = sin.unsqueeze(-2)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """``out = x * cos + sign * rotate_half(x) * sin`` in three kernels: no ``neg``, no ``cat``.

    ``cos`` is the full (duplicated) table and ``sin`` its first half, both broadcastable.
    """
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    out[..., :half].addcmul_(x[..., half:], sin, value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin, value=sign)


class _RotaryFn(torch.autograd.Function):
    """Eager RoPE: the rotation is orthogonal, so the backward is the inverse rotation of the
    gradient (the same kernel with ``sin`` negated) and nothing but the tables is saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        c, s = cos.unsqueeze(-2), sin[..., :half].unsqueeze(-2)
        ctx.save_for_backward(c, s)
        xf = x.float()
        out = torch.empty_like(xf)
        _rotate_into(out, xf, c, s, 1.0)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        c, s = ctx.saved_tensors
        g = grad.float()
        out = torch.empty_like(g)
        _rotate_into(out, g, c, s, -1.0)
        return out.to(grad.dtype), None, None
