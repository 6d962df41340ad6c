"""Cheaper eager CPU formulations of RMSNorm and RoPE, with closed-form backwards.

Why: on CPU, eager autograd runs every elementwise op as its own kernel over the whole
activation and every call costs microseconds of dispatch. ``F.rms_norm`` is a composite
(pow, mean, add, rsqrt, two muls) whose backward runs another ten kernels; ``rotate_half``
costs a ``neg``, a ``cat`` and, in the backward, two zero-filled slice gradients. Here they
are ``autograd.Function``s computing the same functions with fewer kernels and calls:

- RMSNorm: the forward is the composite's own op sequence (bitwise equal); the backward is
  the closed form ``rstd * (g w - xhat * mean(g w xhat))``, ``sum(g xhat)`` for the weight.
  It saves the normalised input and ``rstd`` (what the fused CUDA kernel saves, in bytes),
  not the composite's input *and* normalised input.
- RoPE (:func:`rotary`): ``x * cos + roll(x) * [-s1, s2]`` for q and k in one pass, with
  per-head tables built once per position slice (:class:`RopeTables`); its backward is the
  transposed rotation. It saves no activation, only (a reference to) the tables.

The forwards are bitwise the plain ones; gradients differ by float rounding only (tests
compare both). They run only for plain CPU tensors outside ``torch.compile``
(:func:`eager_cpu`): under compile the plain formulations are what the compiler fuses (the
fast path on GPU), DTensor inputs need the plain ops DTensor knows how to shard, and CUDA
has fused kernels of its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_PLAIN = (torch.Tensor, nn.Parameter)


def eager_cpu(*tensors: torch.Tensor) -> bool:
    """True outside ``torch.compile`` when every tensor is a plain (non-DTensor) CPU tensor."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:  # noqa: SIM110 (a loop, not all(...): this runs several times per block and layer)
        if type(t) not in _PLAIN or t.device.type != "cpu":
            return False
    return True


def rms_forward(xf: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """``(xhat, rstd, xhat * weight)`` of an fp32 ``xf``: the composite's own op sequence (bitwise equal)."""
    squares = xf * xf  # what pow(2) computes; its buffer then takes the output (one buffer fewer)
    rstd = squares.mean(-1, keepdim=True).add_(eps).rsqrt_()
    xhat = xf * rstd
    w = weight if weight.dtype == torch.float32 else weight.float()
    return xhat, rstd, torch.mul(xhat, w, out=squares)


def rms_backward(
    g: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, need_weight: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(grad_x, grad_weight)`` from the fp32 gradient ``g`` of the norm's output (closed form)."""
    dim = xhat.shape[-1]
    w = weight if weight.dtype == torch.float32 else weight.float()
    gxhat = g * xhat
    grad_w = gxhat.reshape(-1, dim).sum(0) if need_weight else None
    rstd_mean = torch.matmul(gxhat, w).unsqueeze_(-1).mul_(rstd)  # rstd * sum(g w xhat) per row (an mv)
    grad_x = torch.mul(g, w, out=gxhat).mul_(rstd).addcmul_(xhat, rstd_mean, value=-1.0 / dim)
    return grad_x, grad_w


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm over the last dimension in fp32 (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xhat, rstd, out = rms_forward(x if x.dtype == torch.float32 else x.float(), weight, eps)
        ctx.save_for_backward(xhat, rstd, weight)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        xhat, rstd, weight = ctx.saved_tensors
        g = grad if grad.dtype == torch.float32 else grad.float()
        grad_x, grad_w = rms_backward(g, xhat, rstd, weight, ctx.needs_input_grad[1])
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if grad_x.dtype != grad.dtype:
            grad_x = grad_x.to(grad.dtype)
        return (grad_x if ctx.needs_input_grad[0] else None), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32, cast back to ``x``'s dtype."""
    out = _RMSNormFn.apply(x, weight, eps)
    assert isinstance(out, torch.Tensor)
    return out


_TABLE_CAP = 1 << 20  # elements of one expanded per-head table; larger ones stay broadcast views


class RopeTables:
    """The tables one RoPE position table pair ``(cos, sin)`` needs, per head count.

    With halves ``s = [s1, s2]``: ``x * cos + rotate_half(x) * sin = x * cos + roll(x) * [-s1, s2]``
    (``roll`` swaps the halves), and the transpose is ``g * cos + roll(g) * [s2, -s1]``. Shared
    ``[T, hd]`` tables are expanded over the heads, so each product runs as one contiguous loop
    over ``T * heads * hd`` elements rather than ``T * heads`` loops of ``hd``; per-token
    ``[B, T, hd]`` tables (and very long ones) stay broadcast views. They are built for the
    first layer and reused by every other layer, by the backward and by later forwards over
    the same positions: on this path every tensor call costs microseconds, whatever its size.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        half = cos.shape[-1] // 2
        s1, s2 = sin.split(half, -1)
        self.key = _table_key(cos, sin)
        self._cos, self._sin = cos, sin  # holds their storage, so no other tensor can take its address
        self._base = (cos, torch.cat((-s1, s2), -1), torch.cat((s2, -s1), -1))
        self._per_heads: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cos, sin for the forward, sin for the transpose)``, each broadcastable to ``[..., T, heads, hd]``."""
        tables = self._per_heads.get(heads)
        if tables is None:
            shape = (*self._cos.shape[:-1], heads, self._cos.shape[-1])
            expand = self._cos.dim() == 2 and math.prod(shape) <= _TABLE_CAP
            views = [t.unsqueeze(-2) for t in self._base]
            c, fwd, bwd = [v.expand(shape).contiguous() for v in views] if expand else views
            tables = self._per_heads[heads] = (c, fwd, bwd)
        return tables


def _table_key(cos: torch.Tensor, sin: torch.Tensor) -> tuple[object, ...]:
    """Same key, same numbers: the same memory, viewed the same way, not written since (a view shares
    its base's version counter, so an in-place write to the buffer changes the key)."""
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t._version) for t in (cos, sin))


_last_tables: RopeTables | None = None


def rope_tables_of(cos: torch.Tensor, sin: torch.Tensor) -> RopeTables:
    """The :class:`RopeTables` of this ``(cos, sin)`` pair, reused while the same table slices come
    back unmodified: every layer of a forward, and every forward at the same sequence length."""
    global _last_tables
    last = _last_tables
    if last is None or last.key != _table_key(cos, sin):
        last = _last_tables = RopeTables(cos, sin)
    return last


def _rotate(x: torch.Tensor, cos: torch.Tensor, swapped_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + roll(x) * swapped_sin`` in fp32, cast back to ``x``'s dtype.

    Each element is one product plus one product, rounded as the plain ``rotate_half``
    formulation rounds them (``x2 * -s1`` is ``-(x2 * s1)`` exactly), so the forward is
    bitwise the plain one.
    """
    xf = x if x.dtype == torch.float32 else x.float()
    out = torch.mul(xf, cos).add_(xf.roll(x.shape[-1] // 2, -1).mul_(swapped_sin))
    return out if out.dtype == x.dtype else out.to(x.dtype)


class _RotaryFn(torch.autograd.Function):
    """RoPE in fp32 of any number of ``[B, T, H, hd]`` tensors at the same positions (q and k in
    one call). The rotation is linear in ``x``, so the backward is its transpose; nothing is
    saved but the tables (derived from the model's RoPE buffers, shared by every layer)."""

    @staticmethod
    def forward(ctx: Any, cos: torch.Tensor, sin: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tables = rope_tables_of(cos, sin)
        ctx.tables = tables
        out = []
        for x in xs:
            c, s_fwd, _ = tables.get(x.shape[-2])
            out.append(_rotate(x, c, s_fwd))
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = [None, None]
        for g in grads:
            c, _, s_bwd = ctx.tables.get(g.shape[-2])
            out.append(_rotate(g, c, s_bwd))
        return tuple(out)


def rotary(xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x * cos + rotate_half(x) * sin`` of each ``[B, T, H, hd]`` ``x`` (``cos``/``sin`` ``[T, hd]`` or
    ``[B, T, hd]``, without the heads dimension), in fp32, cast back."""
    out = _RotaryFn.apply(cos, sin, *xs)
    assert isinstance(out, tuple)
    return out
