"""Cheaper eager CPU formulations of the block's layers, with closed-form backwards.

Why: on CPU, eager autograd runs every elementwise op as its own kernel over the whole
activation and every call costs microseconds of dispatch, and three of the model's layers
are composites of many such ops. ``F.rms_norm`` is a composite (pow, mean, add, rsqrt, two
muls) whose backward runs another ten kernels; ``rotate_half`` costs a ``neg``, a ``cat``
and, in the backward, two zero-filled slice gradients; and ``F.gelu(approximate="tanh")``
calls a tanh that the CPU kernel computes slowly (about as slow as the MLP's matmul on
small widths). Here they are ``autograd.Function``s computing the same functions with
fewer kernels and calls:

- RMSNorm: the forward is the composite's own op sequence (bitwise equal); the backward is
  the closed form ``rstd * (g w - xhat * mean(g w xhat))``, ``sum(g xhat)`` for the weight.
  It saves the normalised input and ``rstd`` (what the fused CUDA kernel saves, in bytes),
  not the composite's input *and* normalised input.
- RoPE (:func:`rotary`, where the projections are not fused: QK-norm, MoT):
  ``x * cos + roll(x) * [-s1, s2]`` for q and k in one pass, with per-head tables built once
  per position slice (:class:`_RopeTables`); its backward is the transposed rotation. It
  saves no activation, only (a reference to) the tables.
- Attention's input side (:func:`qkv_rope`): the block's RMSNorm, the q/k/v projections as
  one matmul over the stacked weights, and RoPE as one complex multiplication per pair (the
  q/k rows are reordered so each head's pairs sit side by side), in one call.
- The MLP's input side (:func:`linear_gelu`): the block's RMSNorm, ``w1`` and tanh-GELU as
  ``h * sigmoid(2u)`` (exactly ``0.5 h (1 + tanh(u))``; sigmoid is a fast CPU kernel), whose
  derivative is computed in the forward and saved in place of its input.

Everything saves the same bytes as the unfused layers (the planner's formula test checks
it). The results differ from the plain formulations by float rounding only (tests compare
forwards and gradients); the standalone RMSNorm and RoPE forwards are bitwise the plain ones. They run
only for plain fp32 CPU tensors outside ``torch.compile`` (:func:`eager_cpu`, :func:`fusable`):
under compile the plain formulations are what the compiler fuses (the fast path on GPU),
DTensor inputs need the plain ops DTensor knows how to shard, and CUDA has fused kernels of
its own.
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
    for t in tensors:  # noqa: SIM110 (a loop, not all(...): this runs several times per block and layer)
        if type(t) not in _PLAIN or t.device.type != "cpu":
            return False
    return True


def _rms_forward(xf: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """``(xhat, rstd, xhat * weight)`` of an fp32 ``xf``: the composite's own op sequence (bitwise equal)."""
    squares = xf * xf  # what pow(2) computes; its buffer then takes the output (one buffer fewer)
    rstd = squares.mean(-1, keepdim=True).add_(eps).rsqrt_()
    xhat = xf * rstd
    w = weight if weight.dtype == torch.float32 else weight.float()
    return xhat, rstd, torch.mul(xhat, w, out=squares)


def _rms_backward(
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
        xhat, rstd, out = _rms_forward(x if x.dtype == torch.float32 else x.float(), weight, eps)
        ctx.save_for_backward(xhat, rstd, weight)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        xhat, rstd, weight = ctx.saved_tensors
        g = grad if grad.dtype == torch.float32 else grad.float()
        grad_x, grad_w = _rms_backward(g, xhat, rstd, weight, ctx.needs_input_grad[1])
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
        self._paired: bool | None = None
        self._phases: dict[int, torch.Tensor] = {}
        self._inverse: torch.Tensor | None = None

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

    def paired(self) -> bool:
        """Both halves of ``cos`` and of ``sin`` are equal (RoPE's tables: each frequency twice), so
        the rotation is a complex multiplication of the pairs ``(x_i, x_{i + hd/2})``."""
        if self._paired is None:
            c1, c2 = self._cos.chunk(2, -1)
            s1, s2 = self._sin.chunk(2, -1)
            self._paired = bool(torch.equal(c1, c2) and torch.equal(s1, s2))
        return self._paired

    def phases(self, heads: int) -> torch.Tensor:
        """``exp(i theta)`` ``[..., T, heads, hd/2]`` (complex), for token-major pairs; see :meth:`get`."""
        table = self._phases.get(heads)
        if table is None:
            half = self._cos.shape[-1] // 2
            base = torch.complex(self._cos[..., :half], self._sin[..., :half]).unsqueeze(-2)
            shape = (*base.shape[:-2], heads, half)
            expand = self._cos.dim() == 2 and math.prod(shape) <= _TABLE_CAP
            table = self._phases[heads] = base.expand(shape).contiguous() if expand else base
        return table

    def inverse_phases_head_major(self) -> torch.Tensor:
        """``exp(-i theta)`` broadcastable to head-major ``[B, heads, T, hd/2]`` pairs without expansion."""
        if self._inverse is None:
            half = self._cos.shape[-1] // 2
            table = torch.complex(self._cos[..., :half], -self._sin[..., :half])
            self._inverse = table if table.dim() == 2 else table.unsqueeze(1)
        return self._inverse


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


def fusable(*tensors: torch.Tensor) -> bool:
    """The fused projections below apply: :func:`eager_cpu`, fp32 throughout, and no CPU autocast."""
    if not eager_cpu(*tensors) or torch.is_autocast_enabled("cpu"):
        return False
    for t in tensors:  # noqa: SIM110 (as in eager_cpu)
        if t.dtype != torch.float32:
            return False
    return True


def _normed_input(
    x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(linear input, xhat, rstd)``: the RMSNorm of ``x`` when there is a norm weight, else ``x`` itself."""
    if norm_weight is None:
        return x, None, None
    xhat, rstd, normed = _rms_forward(x, norm_weight, eps)
    return normed, xhat, rstd


def _input_grads(
    ctx: Any, grad_normed: torch.Tensor, xhat: torch.Tensor | None, rstd: torch.Tensor | None, nw: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_norm_weight)`` of a fused projection from the gradient of its linear input."""
    if nw is None or xhat is None or rstd is None:
        return grad_normed, None
    return _rms_backward(grad_normed, xhat, rstd, nw, ctx.needs_input_grad[1])


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
        tables = _rope_tables(cos, sin)
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
    return _rope_tables(cos, sin).paired()


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
        s = torch.addcmul(h, u, h, value=_GELU_A).mul_(2.0 * _GELU_K).sigmoid_()
        out = h * s
        if grad:  # d/dh [h s(v)] = s + h s (1 - s) v',  v = 2k (h + a h^3),  h v' = 2k (h + 3a h^3)
            hv = torch.addcmul(h, u, h, value=3.0 * _GELU_A, out=u)  # h v' / 2k
            torch.ops.aten.sigmoid_backward(hv, s, grad_input=hv)  # h v' s (1 - s) / 2k
            ctx.save_for_backward(normed, xhat, rstd, norm_weight, w1, s.add_(hv, alpha=2.0 * _GELU_K))
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
