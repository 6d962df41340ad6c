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
- RoPE: the rotation written into one output buffer (a mul, then a product added into
  each half); its backward is the transposed rotation. It saves only the cos/sin tables.
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
        xf = x.float()
        rstd = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        xhat = xf * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.x_dtype = x.dtype
        return (xhat * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        xhat, rstd, weight = ctx.saved_tensors
        g = grad.float()
        w = weight.float()
        grad_w = None
        gxhat = g * xhat
        if ctx.needs_input_grad[1]:
            grad_w = gxhat.reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            mean_gwx = torch.matmul(gxhat, w).unsqueeze(-1).div_(xhat.shape[-1])  # mean(g w xhat) per row
            grad_x = (g * w).mul_(rstd).addcmul_(xhat, mean_gwx.mul_(rstd), value=-1.0).to(ctx.x_dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32, cast back to ``x``'s dtype."""
    out = _RMSNormFn.apply(x, weight, eps)
    assert isinstance(out, torch.Tensor)
    return out


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    """``out = x * cos + rotate_half(x) * sin`` (or its transpose) in three kernels, no ``neg``/``cat``.

    With halves ``x = [x1, x2]``: ``out1 = c1 x1 - s1 x2``, ``out2 = c2 x2 + s2 x1``. The transpose
    (the backward) is ``out1 = c1 x1 + s2 x2``, ``out2 = c2 x2 - s1 x1``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    s1, s2 = sin[..., :half], sin[..., half:]
    torch.mul(x, cos, out=out)
    if inverse:
        out[..., :half].addcmul_(x2, s2)
        out[..., half:].addcmul_(x1, s1, value=-1.0)
    else:  # a product, then a sum (no fused multiply-add): bitwise the plain formulation's (and HF's) forward
        out[..., :half].sub_(x2 * s1)
        out[..., half:].add_(x1 * s2)


class _RotaryFn(torch.autograd.Function):
    """RoPE in fp32; the rotation is linear in ``x``, so the backward is its transpose and only
    the (broadcast views of the) tables are saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        ctx.save_for_backward(cos, sin)
        xf = x.float()
        out = torch.empty_like(xf)
        _rotate_into(out, xf, cos, sin, inverse=False)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        g = grad.float()
        out = torch.empty_like(g)
        _rotate_into(out, g, cos, sin, inverse=True)
        return out.to(grad.dtype), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``cos``/``sin`` without the heads dimension), in fp32, cast back."""
    out = _RotaryFn.apply(x, cos, sin)
    assert isinstance(out, torch.Tensor)
    return out


class _GeluTanhFn(torch.autograd.Function):
    """``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``, equal to tanh-GELU; saves only ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.addcmul(x, x * x, x, value=_GELU_A).mul_(2.0 * _GELU_K).sigmoid_().mul_(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # d/dx [x s(v)] = s + x s (1 - s) v',  v = 2k (x + a x^3),  v' = 2k (1 + 3 a x^2)
        (x,) = ctx.saved_tensors
        x2 = x * x
        s = torch.addcmul(x, x2, x, value=_GELU_A).mul_(2.0 * _GELU_K).sigmoid_()
        x_dv = x2.mul_(6.0 * _GELU_K * _GELU_A).add_(2.0 * _GELU_K).mul_(x)
        s_1ms = torch.addcmul(s, s, s, value=-1.0)
        return s.addcmul_(x_dv, s_1ms).mul_(grad)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU of an fp32 tensor (see :class:`_GeluTanhFn`)."""
    out = _GeluTanhFn.apply(x)
    assert isinstance(out, torch.Tensor)
    return out
