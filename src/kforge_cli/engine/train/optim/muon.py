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

Sharded matrices (FSDP2, HSDP, TP, FSDP x TP; ``distributed=True``, setting
``optimizer.muon_distributed``): Newton-Schulz needs the whole matrix, but only one rank of
the parameter's mesh computes it; the ranks split the matrices between them and exchange
blocks with two all-to-alls (engine.train.optim.muon_distributed). The update is bitwise the
one of ``distributed=False``, where every rank gathers (``full_tensor()``) and orthogonalises
every matrix.

Why not ``torch.optim.Muon`` (torch 2.13): its update equals this one up to rounding, but
(1) its momentum buffer is an EMA (``lerp``), (1 - momentum) x this one's: Newton-Schulz's
normalisation cancels the factor in the update, not in the checkpointed state, so resuming
kforge runs would change; (2) its Newton-Schulz always runs in bf16 (fp32 here on CPU, the
tested path); (3) it takes 2-D parameters only, while this one optimizer also holds the AdamW
groups the scheduler and checkpoint see; (4) on DTensors it runs every matrix's Newton-Schulz
through DTensor ops on every rank, with no split of the work. tests/unit/test_optimizer.py
checks (1) and the equal update against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from kforge_cli.engine.train.optim.muon_distributed import (
    ROUND_BYTES,
    Matrix,
    SplitPlan,
    build_plan,
    mesh_group,
    newton_schulz_flops,
    orthogonalise_split,
)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# torch's form of a param group (``params``, ``lr``, ``weight_decay``, ... and kforge's ``name``, ``use_muon``)
ParamGroup: TypeAlias = dict[str, Any]


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


@dataclass
class _Job:
    """One Muon parameter of this step, its momentum already updated."""

    param: torch.Tensor
    grad: torch.Tensor
    buf: torch.Tensor
    group: ParamGroup

    def update(self) -> torch.Tensor:
        """``g + momentum * buf`` (nesterov) or ``buf``; a DTensor for a DTensor parameter."""
        if self.group["nesterov"]:
            return self.grad.add(self.buf, alpha=self.group["momentum"])
        return self.buf

    def local_update(self) -> torch.Tensor:
        """This rank's block of ``update()`` (the same arithmetic on the local tensors)."""
        grad, buf = _local(self.grad), _local(self.buf)
        return grad.add(buf, alpha=self.group["momentum"]) if self.group["nesterov"] else buf


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _apply_update(job: _Job, ortho: torch.Tensor) -> None:
    """``p = p * (1 - lr * wd) - lr * ortho``; ``ortho`` is a DTensor like ``p`` or this rank's block of it."""
    lr: float = job.group["lr"]
    wd: float = job.group["weight_decay"]
    p = job.param
    target = _local(p) if not isinstance(ortho, DTensor) else p
    if wd:
        target.mul_(1.0 - lr * wd)
    target.add_(ortho.to(target.dtype), alpha=-lr)


class Muon(Optimizer):
    """Muon for groups with ``use_muon=True``; AdamW semantics for every other group.

    Group keys: ``lr``, ``weight_decay``, ``use_muon`` and, for Muon groups,
    ``momentum``, ``nesterov``, ``ns_steps``; for AdamW groups ``betas`` and ``eps``.
    Parameters of Muon groups must be 2-D. ``distributed``: split the Newton-Schulz of
    DTensor matrices over their mesh (an owner rank per matrix; ``round_bytes`` of full
    matrices per owner at once) rather than run all of it on every rank.
    ``ns_flops_last_step``: the Newton-Schulz FLOPs this rank ran in the last step.
    """

    def __init__(
        self,
        params: Iterable[ParamGroup],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        distributed: bool = True,
        round_bytes: int = ROUND_BYTES,
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
        self.distributed = distributed
        self.round_bytes = round_bytes
        self._plans: dict[tuple[DeviceMesh, tuple[tuple[int, int], ...]], SplitPlan] = {}
        self.ns_flops_last_step = 0  # Newton-Schulz FLOPs this rank ran in the last step (analytic)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs: list[_Job] = []
        for group in self.param_groups:
            if group["use_muon"]:
                jobs.extend(self._momentum(group))
            else:
                self._adamw_group(group)
        self._orthogonalise_and_apply(jobs)
        return loss

    def _momentum(self, group: ParamGroup) -> list[_Job]:
        """Update the momentum buffers of a Muon group; the jobs that will make and apply its updates."""
        momentum: float = group["momentum"]
        jobs = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf: torch.Tensor = state["momentum_buffer"]
            buf.mul_(momentum).add_(p.grad)
            jobs.append(_Job(p, p.grad, buf, group))
        return jobs

    def _orthogonalise_and_apply(self, jobs: list[_Job]) -> None:
        """Newton-Schulz of every update, split over the ranks of each mesh when ``distributed``."""
        self.ns_flops_last_step = 0
        split: dict[tuple[DeviceMesh, torch.dtype], list[_Job]] = {}
        for job in jobs:
            p = job.param
            if self.distributed and isinstance(p, DTensor) and p.device_mesh.size() > 1 and p.ndim == 2:
                split.setdefault((p.device_mesh, p.dtype), []).append(job)
            else:
                self._gathered(job)
        # groups are created in the same order on every rank (flattening a mesh is a collective over all ranks)
        for key in sorted(split, key=lambda k: (tuple(k[0].mesh_dim_names or ()), str(k[1]))):
            self._split(split[key])

    def _gathered(self, job: _Job) -> None:
        """Every rank orthogonalises the whole matrix, a DTensor gathered first (``distributed=False``,
        plain tensors, a mesh of one rank)."""
        p = job.param
        steps: int = job.group["ns_steps"]
        rows, cols = p.shape
        self.ns_flops_last_step += newton_schulz_flops(rows, cols, steps)
        _apply_update(job, _orthogonalised_update(job.update(), steps, p))

    def _split(self, jobs: list[_Job]) -> None:
        """Each matrix orthogonalised by one owner rank of its mesh (engine.train.optim.muon_distributed)."""
        mesh = cast(DTensor, jobs[0].param).device_mesh
        key = (mesh, tuple((id(j.param), j.group["ns_steps"]) for j in jobs))
        matrices = [Matrix(cast(DTensor, j.param), j.group["ns_steps"], j.local_update) for j in jobs]
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build_plan(mesh_group(mesh), matrices, self.round_bytes)
        self.ns_flops_last_step += plan.flops[plan.rank]

        def orthogonalise(full: torch.Tensor, steps: int) -> torch.Tensor:
            rows, cols = full.shape
            return zeropower_via_newtonschulz(full, steps) * max(1.0, rows / cols) ** 0.5

        def apply(i: int, block: torch.Tensor) -> None:
            _apply_update(jobs[i], block)

        orthogonalise_split(plan, matrices, orthogonalise, apply)
        for i in plan.fallback:
            j = jobs[i]
            _apply_update(j, _orthogonalised_update(j.update(), j.group["ns_steps"], j.param))

    def _adamw_group(self, group: ParamGroup) -> None:
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
