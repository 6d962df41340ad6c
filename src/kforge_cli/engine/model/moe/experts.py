"""Routed experts with stacked weights ``[E, out, in]``, computed by grouped GEMM.

Tokens arrive sorted by expert with ``counts[e]`` rows for expert ``e``. Grouped GEMM
(``torch.nn.functional.grouped_mm``) runs all experts in one kernel. Where it does not
apply the per-expert loop computes the same thing:

- CPU (torch 2.11-2.13, measured on 2.13): fp32 and bf16 alike, but only when every row
  stride is a multiple of 16 bytes (``dim`` and the expert hidden size multiples of 4
  in fp32, of 8 in bf16); otherwise it raises, so such shapes use the loop.
- CUDA: a CUTLASS kernel on compute capability 9.x/10.x (H100/H200/B200) in bf16, torch's
  own (slow) per-group fallback elsewhere and in fp32; same 16-byte rule.
- under ``torch.compile`` (any device): only bf16. The op's meta kernel, which tracing
  runs, accepts nothing else (a traced fp32 call fails with "Expected inputs of BF16
  type"), so compiled fp32/fp16 experts use the loop, traced with the per-expert row
  counts as unbacked sizes (``engine.parallel.build.apply_compile`` sets
  ``capture_scalar_outputs``). The bf16 path keeps grouped GEMM when compiled; a row
  count known only at run time (EP, capacity) gets one zero padding row, since a compiled
  backward runs the weight-gradient GEMM even on zero rows, which grouped GEMM refuses.

Compute dtype: the autocast dtype when autocast is on for the tokens' device (one
process with ``train.dtype = bf16``: the residual stream, and so the tokens, stay fp32,
and autocast has no rule for grouped GEMM, so without this the experts would take the
fp32 fallback), else the tokens' dtype (FSDP's mixed precision hands in bf16 rows).

Both paths keep every expert's weights in the autograd graph even when it got zero
tokens (an empty matmul still produces a (zero) gradient), so FSDP2's reduce-scatter
sees a gradient for every parameter on every rank and never waits on a missing one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's for ``x``'s device when enabled, else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether grouped GEMM accepts these operands with this torch (see module docstring)."""
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
        dtype = compute_dtype(x)
        x = x.to(dtype)
        w1, w2, w3 = (_local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        if not (self.use_grouped_mm and grouped_mm_usable(x, w1, w2)):
            return expert_loop(x, counts, w1, w2, w3)
        rows = x.shape[0]
        if not torch.compiler.is_compiling():
            # No rows at all (an expert-parallel rank whose experts got no tokens in this micro-batch):
            # the loop, since torch 2.13's grouped GEMM backward refuses an empty input.
            if rows == 0:
                return expert_loop(x, counts, w1, w2, w3)
            return _grouped_swiglu(x, counts, w1, w2, w3)
        if statically_known_true(rows > 0):
            return _grouped_swiglu(x, counts, w1, w2, w3)
        # Traced with a row count known only at run time (EP's received rows, capacity dropping), which
        # may be 0: one zero row appended to the last expert keeps every grouped GEMM, the weight
        # gradients' included, non-empty (a zero row adds exactly zero to outputs and gradients).
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        one_more = torch.zeros_like(counts)
        one_more[-1] = 1
        return _grouped_swiglu(padded, counts + one_more, w1, w2, w3)[:rows]


def _grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """Every expert's SwiGLU on its rows of ``x`` (sorted by expert, ``counts`` per expert), as three grouped GEMMs."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(F.grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * F.grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return F.grouped_mm(h, w2.transpose(-2, -1), offs=offs).contiguous()


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
