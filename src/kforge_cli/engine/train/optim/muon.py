"""Muon (MomentUm Orthogonalized by Newton-Schulz) for hidden weight matrices, AdamW for the rest.

Why: for the 2-D weights of the Transformer blocks, replacing the momentum by its
nearest semi-orthogonal matrix (all singular values ~1) gives every direction of the
update the same scale, which trains faster per token than AdamW at the same memory as
SGD-momentum. Embeddings, the output head, norms and biases are not matrices acting on
hidden states, so they keep AdamW. One optimizer object holds both kinds of groups
(flag ``use_muon``), so the loop, the scheduler and the checkpoint see one optimizer.

Muon group, per parameter ``p`` with gradient ``g``::

    buf = momentum * buf + g
    u   = g + momentum * buf   (nesterov)   or   buf
    o   = NewtonSchulz(u) * max(1, rows / cols) ** 0.5
    p   = p * (1 - lr * wd) - lr * o

AdamW groups follow ``torch.optim.AdamW`` exactly (bias-corrected, decoupled decay).
State holds only tensors (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``),
so it is DCP-compatible; a DTensor parameter gets DTensor state with its sharding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def zeropower_via_newtonschulz(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with the singular vectors of ``matrix``.

    Quintic Newton-Schulz iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``
    and Keller Jordan's coefficients, which push every singular value into roughly
    [0.7, 1.2] in 5 steps (not exactly 1: speed over precision, which is what Muon
    needs). ``X`` is first normalised by its Frobenius norm (so the spectral norm is
    <= 1) and transposed when it has more rows than columns (``A`` is then the smaller
    Gram matrix). ``dtype`` defaults to bf16 on CUDA (fast, precise enough) and fp32
    elsewhere (CPU bf16 matmuls are slow). Returns ``matrix``'s dtype.
    """
    if matrix.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    if dtype is None:
        dtype = torch.bfloat16 if matrix.is_cuda else torch.float32
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.t()
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if transposed:
        x = x.t()
    return x.to(matrix.dtype)


def _orthogonalised_update(update: torch.Tensor, steps: int, param: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz of ``update`` scaled by ``max(1, rows/cols)**0.5``; DTensors are gathered first.

    The orthogonalisation needs the whole matrix, so an FSDP2/TP-sharded update is
    gathered with ``full_tensor()`` (every rank then computes the same result) and this
    rank's shard, laid out like ``param``, is taken back locally with
    ``src_data_rank=None`` (no communication).
    """
    rows, cols = update.shape
    scale = max(1.0, rows / cols) ** 0.5
    if isinstance(update, DTensor):
        layout = param if isinstance(param, DTensor) else update
        full = zeropower_via_newtonschulz(update.full_tensor(), steps) * scale
        return distribute_tensor(full, layout.device_mesh, layout.placements, src_data_rank=None)
    return zeropower_via_newtonschulz(update, steps) * scale


class Muon(Optimizer):
    """Muon for groups with ``use_muon=True``; AdamW semantics for every other group.

    Group keys: ``lr``, ``weight_decay``, ``use_muon`` and, for Muon groups,
    ``momentum``, ``nesterov``, ``ns_steps``; for AdamW groups ``betas`` and ``eps``.
    Parameters of Muon groups must be 2-D.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        if lr <= 0.0:
            raise ValueError(f"Muon lr must be positive, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"Muon ns_steps must be >= 1, got {ns_steps}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "betas": tuple(betas),
            "eps": eps,
            "use_muon": False,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                bad = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
                if bad:
                    raise ValueError(f"Muon groups take 2-D matrices only; got shapes {bad}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr: float = group["lr"]
        wd: float = group["weight_decay"]
        momentum: float = group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf: torch.Tensor = state["momentum_buffer"]
            buf.mul_(momentum).add_(grad)
            update = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
            ortho = _orthogonalised_update(update, group["ns_steps"], p)
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(ortho.to(p.dtype), alpha=-lr)

    def _adamw_group(self, group: dict[str, Any]) -> None:
        lr: float = group["lr"]
        wd: float = group["weight_decay"]
        beta1, beta2 = group["betas"]
        eps: float = group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = float(state["step"].item())
            exp_avg: torch.Tensor = state["exp_avg"]
            exp_avg_sq: torch.Tensor = state["exp_avg_sq"]
            if wd:
                p.mul_(1.0 - lr * wd)
            exp_avg.lerp_(grad, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            bias_correction1 = 1.0 - beta1**step
            bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
