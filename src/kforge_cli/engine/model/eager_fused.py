"""Each Transformer block's input sides as single autograd calls, on eager CPU.

Built on the closed forms of :mod:`.eager_cpu`:

- Attention's input side (:func:`qkv_rope`): the block's RMSNorm, the q/k/v projections as
  one matmul over the stacked weights, and RoPE as one complex multiplication per pair (the
  q/k rows are reordered so each head's pairs sit side by side), in one call.
- The MLP's input side (:func:`linear_gelu`): the block's RMSNorm, ``w1`` and tanh-GELU as
  ``h * sigmoid(2u)`` (exactly ``0.5 h (1 + tanh(u))``; sigmoid is a fast CPU kernel), whose
  derivative is computed in the forward and saved in place of its input.

Both save the same bytes as the unfused layers (the planner's formula test checks it) and
give the same numbers up to float rounding. They run only where :func:`fusable` holds: plain
fp32 CPU tensors, no autocast, outside ``torch.compile``; the block also checks that nothing
hooks the layers (tensor parallelism does, and expects the normed input).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kforge_cli.engine.model import eager_cpu
from kforge_cli.engine.model.layers import RMSNorm

GELU_K = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def fusable(*tensors: torch.Tensor) -> bool:
    """The fused calls below apply: :func:`.eager_cpu.eager_cpu`, fp32 throughout, and no CPU autocast."""
    if not eager_cpu.eager_cpu(*tensors) or torch.is_autocast_enabled("cpu"):
        return False
    for t in tensors:  # noqa: SIM110 (as in eager_cpu)
        if t.dtype != torch.float32:
            return False
    return True


def split_norm(x: torch.Tensor, norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """``(input, norm weight, eps)`` of a fused call: an RMSNorm with a fusable weight runs inside
    it; any other norm (LayerNorm, a DTensor weight) runs here first; no norm, ``x`` as it is."""
    if isinstance(norm, RMSNorm) and fusable(norm.weight):
        return x, norm.weight, norm.eps
    return (x if norm is None else norm(x)), None, 0.0


def _normed_input(
    x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(linear input, xhat, rstd)``: the RMSNorm of ``x`` when there is a norm weight, else ``x`` itself."""
    if norm_weight is None:
        return x, None, None
    xhat, rstd, normed = eager_cpu.rms_forward(x, norm_weight, eps)
    return normed, xhat, rstd


def _input_grads(
    ctx: Any, grad_normed: torch.Tensor, xhat: torch.Tensor | None, rstd: torch.Tensor | None, nw: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_norm_weight)`` of a fused projection from the gradient of its linear input."""
    if nw is None or xhat is None or rstd is None:
        return grad_normed, None
    return eager_cpu.rms_backward(grad_normed, xhat, rstd, nw, ctx.needs_input_grad[1])


def _weight_grad(g: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``g^T @ inputs`` over all leading dimensions: a linear layer's weight gradient."""
    return torch.mm(g.flatten(0, -2).t(), inputs.flatten(0, -2))


def _pair_order(heads: int, kv_heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row order of the stacked ``[wq; wk; wv]`` whose q and k heads come out with their RoPE pairs
    ``(i, i + hd/2)`` adjacent (``0, h, 1, h + 1, ...``; v as it is), and its inverse."""
    key = (heads, kv_heads, head_dim, device)
    order = _PAIR_ORDERS.get(key)
    if order is None:
        half = head_dim // 2
        within = torch.arange(head_dim, device=device).view(2, half).t().reshape(-1)  # 0, h, 1, h + 1, ...
        rotated = (torch.arange(heads, device=device) * head_dim).unsqueeze(1) + within
        rows = torch.cat(
            (rotated.reshape(-1), torch.arange(heads * head_dim, (heads + kv_heads) * head_dim, device=device))
        )
        order = _PAIR_ORDERS[key] = (rows, torch.argsort(rows))
    return order


_PAIR_ORDERS: dict[tuple[int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


class _QKVRopeFn(torch.autograd.Function):
    """Attention's input side in one call: optional RMSNorm, the q/k/v projections as one matmul
    over the stacked weights, and RoPE of q and k (see :func:`qkv_rope`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        wq: torch.Tensor,
        wk: torch.Tensor,
        wv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed, xhat, rstd = _normed_input(x, norm_weight, eps)
        q_dim, kv_dim = wq.shape[0], wk.shape[0]
        hq, hk = q_dim // head_dim, kv_dim // head_dim
        order, _ = _pair_order(hq + hk, hk, head_dim, x.device)
        qkv = torch.nn.functional.linear(normed, torch.cat((wq, wk, wv)).index_select(0, order))
        tables = eager_cpu.rope_tables_of(cos, sin)
        # q and k come out pair-interleaved: RoPE is one complex product per pair, written into one
        # token-major buffer (attention's output then comes out token-major too, so the output
        # projection's input is a view of it, not a copy).
        pairs = torch.view_as_complex(qkv[..., : q_dim + kv_dim].unflatten(-1, (hq + hk, head_dim // 2, 2)))
        rotated = torch.view_as_real(pairs * tables.phases(hq + hk)).flatten(-2)
        # A copy, so attention keeps only v alive for its backward, not the whole q/k/v buffer.
        v = qkv[..., q_dim + kv_dim :].unflatten(-1, (hk, head_dim)).contiguous()
        ctx.save_for_backward(normed, xhat, rstd, norm_weight, wq, wk, wv)
        ctx.tables = tables
        ctx.heads = (hq, hk, head_dim)
        return rotated[..., :hq, :], rotated[..., hq:, :], v

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        normed, xhat, rstd, nw, wq, wk, wv = ctx.saved_tensors
        hq, hk, hd = ctx.heads
        order, inverse = _pair_order(hq + hk, hk, hd, normed.device)
        g = gv.new_empty(*gv.shape[:-2], (hq + 2 * hk) * hd)  # the stacked projection's output gradient
        phases = ctx.tables.inverse_phases_head_major()
        for grad, first, heads in ((gq, 0, hq), (gk, hq * hd, hk)):
            # Attention's backward returns head-major gradients, where the table broadcasts over the
            # heads as it is: the transposed rotation (times exp(-i theta)) is written token-major.
            grad_hm = grad.transpose(1, 2)
            if grad_hm.stride(-1) != 1:
                grad_hm = grad_hm.contiguous()
            dst = g[..., first : first + heads * hd].unflatten(-1, (heads, hd // 2, 2)).transpose(1, 2)
            torch.mul(
                torch.view_as_complex(grad_hm.unflatten(-1, (hd // 2, 2))), phases, out=torch.view_as_complex(dst)
            )
        g[..., (hq + hk) * hd :].unflatten(-1, (hk, hd)).copy_(gv)
        stacked = torch.cat((wq, wk, wv)).index_select(0, order)
        grad_x, grad_nw = _input_grads(ctx, torch.matmul(g, stacked), xhat, rstd, nw)
        gw = _weight_grad(g, normed).index_select(0, inverse)
        gwq, gwk, gwv = gw.split((wq.shape[0], wk.shape[0], wv.shape[0]))
        return grad_x, grad_nw, None, gwq, gwk, gwv, None, None, None


def paired_rope(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """These tables rotate pairs ``(i, i + hd/2)`` by one angle (RoPE's always do): :func:`qkv_rope` applies."""
    return eager_cpu.rope_tables_of(cos, sin).paired()


def qkv_rope(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` ``[B, T, heads, head_dim]`` of ``x`` ``[B, T, D]``: RMSNorm (with ``norm_weight``; none
    without), the projections ``wq, wk, wv`` and RoPE of q and k, in fp32, for attention only:
    **q and k come back with each head's dimensions reordered** so RoPE's pairs ``(i, i + hd/2)``
    sit side by side (``0, hd/2, 1, hd/2 + 1, ...``). Attention's scores ``q . k`` are the same
    sums over a permuted order, so nothing downstream changes (v keeps its order); a KV cache
    filled by this path must be read by it, which one model on one device and dtype always does.
    Needs tables whose halves are equal (:func:`paired_rope`).

    Why: the projection becomes one matmul over the stacked, row-reordered weights instead of
    three (and one for the input gradient instead of three plus two adds), and RoPE becomes
    one complex multiplication per pair in the forward and one (by ``exp(-i theta)``, on
    attention's head-major gradients) per tensor in the backward, instead of
    ``x * cos + rotate_half(x) * sin``'s four passes with a copy. q and k are views of one
    buffer; v is copied out so attention does not keep the whole projection output. It saves
    what the unfused layers save: the norm's normalised input and ``rstd`` and its output (the
    projections' input); RoPE saves nothing. Same numbers up to float rounding.
    """
    wq, wk, wv = weights
    out = _QKVRopeFn.apply(x, norm_weight, eps, wq, wk, wv, cos, sin, head_dim)
    assert isinstance(out, tuple)
    return out


class _LinearGeluFn(torch.autograd.Function):
    """The MLP's input side in one call: optional RMSNorm, ``w1`` and tanh-GELU (see :func:`linear_gelu`)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, w1: torch.Tensor, grad: bool
    ) -> torch.Tensor:
        normed, xhat, rstd = _normed_input(x, norm_weight, eps)
        h = torch.nn.functional.linear(normed, w1)
        u = h * h  # one buffer, reused in place: every fresh activation-sized buffer costs page faults on CPU
        s = torch.addcmul(h, u, h, value=GELU_A).mul_(2.0 * GELU_K).sigmoid_()
        out = h * s
        if grad:  # d/dh [h s(v)] = s + h s (1 - s) v',  v = 2k (h + a h^3),  h v' = 2k (h + 3a h^3)
            hv = torch.addcmul(h, u, h, value=3.0 * GELU_A, out=u)  # h v' / 2k
            torch.ops.aten.sigmoid_backward(hv, s, grad_input=hv)  # h v' s (1 - s) / 2k
            ctx.save_for_backward(normed, xhat, rstd, norm_weight, w1, s.add_(hv, alpha=2.0 * GELU_K))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        normed, xhat, rstd, nw, w1, derivative = ctx.saved_tensors
        gh = grad * derivative
        grad_x, grad_nw = _input_grads(ctx, torch.matmul(gh, w1), xhat, rstd, nw)
        return grad_x, grad_nw, None, _weight_grad(gh, normed), None


def linear_gelu(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, w1: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(w1 @ rms_norm(x))`` (no norm without ``norm_weight``) of fp32 ``x``, in one call.

    tanh-GELU is computed as ``h * sigmoid(2u)`` (``u = sqrt(2/pi)(h + 0.044715 h^3)``: equal to
    ``0.5 h (1 + tanh(u))``, and sigmoid is a much faster CPU kernel than tanh). The forward
    also computes the GELU's derivative and saves it *instead of* its input (same bytes), so
    the backward is one multiply rather than the native kernel's tanh recomputation.
    """
    out = _LinearGeluFn.apply(x, norm_weight, eps, w1, torch.is_grad_enabled())
    assert isinstance(out, torch.Tensor)
    return out
