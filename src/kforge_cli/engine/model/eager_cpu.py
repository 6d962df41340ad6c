"""Cheaper eager CPU formulations of RMSNorm, RoPE and tanh-GELU, with closed-form backwards.

Why: on CPU, eager autograd runs every elementwise op as its own kernel over the whole
activation, and three of the model's layers are composites of many such ops. ``F.rms_norm``
is a composite (pow, mean, add, rsqrt, two muls) whose backward runs another ten kernels;
``rotate_half`` costs a ``neg``, a ``cat`` and, in the backward, two zero-filled slice
gradients; and ``F.gelu(approximate="tanh")`` calls a tanh that the CPU kernel computes
slowly (about as slow as the MLP's matmul on small widths). Here each is one small
``autograd.Function`` computing the same function with fewer kernels:

- RMSNorm: the forward is the composite's own op sequence (bitwise equal); the backward is
  the closed form ``rstd * (g w - xhat * mean(g w xhat))``, ``sum(g xhat)`` for the weight.
  It saves the normalised input and ``rstd`` (what the fused CUDA kernel saves, in bytes),
  not the composite's input *and* normalised input.
- RoPE: ``x * cos + roll(x) * [-s1, s2]`` for q and k in one call, with per-head tables built
  once per position slice (:class:`_RopeTables`); its backward is the transposed rotation.
  It saves no activation, only (a reference to) the tables.
- tanh-GELU: ``0.5 x (1 + tanh(u)) = x * sigmoid(2u)`` exactly (``u = sqrt(2/pi)(x + 0.044715 x^3)``),
  and sigmoid is a fast CPU kernel; the backward recomputes from the saved input, as
  ``aten::gelu_backward`` does. fp32 inputs only (a bf16 composite would round more often
  than the native kernel, which computes in fp32).

The results differ from the composite formulations by float rounding only (tests compare
forward and gradients); the RMSNorm and RoPE forwards are bitwise the plain ones. They run only for plain CPU tensors outside ``torch.compile``
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
_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def eager_cpu(*tensors: torch.Tensor) -> bool:
    """True outside ``torch.compile`` when every tensor is a plain (non-DTensor) CPU tensor."""
    if torch.compiler.is_compiling():
        return False
    return all(type(t) in _PLAIN and t.device.type == "cpu" for t in tensors)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm over the last dimension in fp32 (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        fp32 = x.dtype == torch.float32 and weight.dtype == torch.float32
        xf = x if fp32 else x.float()
        squares = xf * xf  # what pow(2) computes; its buffer then takes the output (one buffer fewer)
        rstd = squares.mean(-1, keepdim=True).add_(eps).rsqrt_()
        xhat = xf * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        if fp32:
            return torch.mul(xhat, weight, out=squares)
        return (xhat * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        xhat, rstd, weight = ctx.saved_tensors
        dim = xhat.shape[-1]
        g = grad if grad.dtype == torch.float32 else grad.float()
        w = weight if weight.dtype == torch.float32 else weight.float()
        gxhat = g * xhat
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = gxhat.reshape(-1, dim).sum(0)
            grad_w = grad_w if weight.dtype == torch.float32 else grad_w.to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            rstd_mean = torch.matmul(gxhat, w).unsqueeze_(-1).mul_(rstd)  # rstd * sum(g w xhat) per row (an mv)
            grad_x = torch.mul(g, w, out=gxhat).mul_(rstd).addcmul_(xhat, rstd_mean, value=-1.0 / dim)
            grad_x = grad_x if grad.dtype == torch.float32 else grad_x.to(grad.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32, cast back to ``x``'s dtype."""
    out = _RMSNormFn.apply(x, weight, eps)
    assert isinstance(out, torch.Tensor)
    return out


_TABLE_CAP = 1 << 20  # elements of one expanded per-head table; larger ones stay broadcast views


class _RopeTables:
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


_last_tables: _RopeTables | None = None


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> _RopeTables:
    """The :class:`_RopeTables` of this ``(cos, sin)`` pair, reused while the same table slices come
    back unmodified: every layer of a forward, and every forward at the same sequence length."""
    global _last_tables
    last = _last_tables
    if last is None or last.key != _table_key(cos, sin):
        last = _last_tables = _RopeTables(cos, sin)
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
        tables = _rope_tables(cos, sin)
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


class _GeluTanhFn(torch.autograd.Function):
    """``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``, equal to tanh-GELU; saves only ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        u = x * x  # one buffer, reused in place: every fresh activation-sized buffer costs page faults on CPU
        return torch.addcmul(x, u, x, value=_GELU_A, out=u).mul_(2.0 * _GELU_K).sigmoid_().mul_(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # d/dx [x s(v)] = s + x s (1 - s) v',  v = 2k (x + a x^3),  x v' = 2k (x + 3a x^3)
        (x,) = ctx.saved_tensors
        x_dv = x * x
        s = torch.addcmul(x, x_dv, x, value=_GELU_A).mul_(2.0 * _GELU_K).sigmoid_()
        torch.addcmul(x, x_dv, x, value=3.0 * _GELU_A, out=x_dv)  # x v' / 2k
        torch.ops.aten.sigmoid_backward(x_dv, s, grad_input=x_dv)  # x v' s (1 - s) / 2k
        return s.add_(x_dv, alpha=2.0 * _GELU_K).mul_(grad)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU of an fp32 tensor (see :class:`_GeluTanhFn`)."""
    out = _GeluTanhFn.apply(x)
    assert isinstance(out, torch.Tensor)
    return out
