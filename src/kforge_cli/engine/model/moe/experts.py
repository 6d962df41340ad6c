"""Routed experts with stacked weights ``[E, out, in]``, computed by grouped GEMM.

Tokens arrive sorted by expert with ``counts[e]`` rows for expert ``e``. Grouped GEMM
(``torch.nn.functional.grouped_mm``, in torch >= 2.9; ``torch._grouped_mm`` before)
runs all experts in one kernel. Where it is unavailable the per-expert loop computes
the same thing:

- torch 2.13 CPU (measured): works for fp32 and bf16 alike, but only when every row
  stride is a multiple of 16 bytes (``dim`` and the expert hidden size multiples of 4
  in fp32, of 8 in bf16); otherwise it raises, so such shapes use the loop.
- CUDA (torch >= 2.8): always available; a CUTLASS kernel on compute capability 9.x/10.x
  (H100/H200/B200) in bf16, torch's own per-group fallback elsewhere; same 16-byte rule.
- torch builds without the op (< 2.8): the loop.
- under ``torch.compile`` (torch 2.13, any device): only bf16. The op's meta kernel, which
  tracing runs, accepts nothing else (eager CPU takes fp32; a traced fp32 call fails with
  "Expected inputs of BF16 type"), so compiled fp32/fp16 experts use the loop, traced with
  the per-expert row counts as unbacked sizes (``engine.parallel.build.apply_compile``
  sets ``capture_scalar_outputs``). The GPU bf16 path keeps grouped GEMM when compiled; a row
  count known only at run time (EP, capacity) gets one zero padding row, since a compiled
  backward runs the weight-gradient GEMM even on zero rows, which grouped GEMM refuses.

Both paths keep every expert's weights in the autograd graph even when it got zero
tokens (an empty matmul still produces a (zero) gradient), so FSDP2's reduce-scatter
sees a gradient for every parameter on every rank and never waits on a missing one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

GroupedMM = Callable[..., torch.Tensor]


def grouped_mm_op() -> GroupedMM | None:
    """This torch's grouped GEMM (public name first), or None."""
    op = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return cast(GroupedMM, op) if callable(op) else None


def grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether grouped GEMM accepts these operands with this torch (see module docstring)."""
    if grouped_mm_op() is None:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # decided while tracing: the traced op takes only bf16 (module docstring)
    item = x.element_size()
    return all((t.shape[-1] * item) % 16 == 0 and (t.shape[-2] * item) % 16 == 0 for t in weights)


class GroupedExperts(nn.Module):
    """SwiGLU experts: ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``.

    ``w1``/``w3`` are ``[E, hidden, dim]`` and ``w2`` is ``[E, dim, hidden]`` (nn.Linear's
    ``[out, in]`` per expert), the layout Hugging Face MoE checkpoints split per expert.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, dim]`` sorted by expert, ``counts`` ``[E]`` rows per expert -> ``[M, dim]``."""
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        op = grouped_mm_op()
        if not (self.use_grouped_mm and op is not None and grouped_mm_usable(x, w1, w2)):
            return expert_loop(x, counts, w1, w2, w3)
        rows = x.shape[0]
        if not torch.compiler.is_compiling():
            # No rows at all (an expert-parallel rank whose experts got no tokens in this micro-batch):
            # the loop, since torch 2.13's grouped GEMM backward refuses an empty input.
            if rows == 0:
                return expert_loop(x, counts, w1, w2, w3)
            return _grouped_swiglu(op, x, counts, w1, w2, w3)
        if statically_known_true(rows > 0):
            return _grouped_swiglu(op, x, counts, w1, w2, w3)
        # Traced with a row count known only at run time (EP's received rows, capacity dropping), which
        # may be 0: one zero row appended to the last expert keeps every grouped GEMM, the weight
        # gradients' included, non-empty (a zero row adds exactly zero to outputs and gradients).
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        one_more = torch.zeros_like(counts)
        one_more[-1] = 1
        return _grouped_swiglu(op, padded, counts + one_more, w1, w2, w3)[:rows]


def _grouped_swiglu(
    op: GroupedMM, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """Every expert's SwiGLU on its rows of ``x`` (sorted by expert, ``counts`` per expert), as three grouped GEMMs."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(op(x, w1.transpose(-2, -1), offs=offs)) * op(x, w3.transpose(-2, -1), offs=offs)
    return op(h, w2.transpose(-2, -1), offs=offs).contiguous()


def expert_loop(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The per-expert reference path (and fallback): one SwiGLU per expert on its rows."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
        h = F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())
        outs.append(h @ w2[e].t())
    return torch.cat(outs, dim=0)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert-parallel ``Shard(0)`` DTensor parameter, else ``t``.

    An ``isinstance`` test, not duck typing: torch.compile traces it (a ``callable(getattr(...))``
    test was not, leaving a DTensor in the grouped GEMM)."""
    return t.to_local() if isinstance(t, DTensor) else t
