"""The global gradient norm and clipping across every mesh dim (dp, tp, and pp).

Each rank sums the squares of its *local* gradient shards, grouped by the mesh dims
the gradients are sharded over; each group's sum is all-reduced over exactly those
dims (a dim where the gradient is replicated must not be summed, or its share would
count several times); pipeline stages then add their sums over the ``pp`` group,
since each stage holds different parameters. The clip coefficient is then the same
on every rank, so every shard is scaled alike, as torch's ``clip_grad_norm_`` would
do on the whole model in one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

_Key = tuple[object, ...]  # (mesh dim names, mesh shape, sharded dims), or ("local",)


def _group_key(grad: torch.Tensor) -> tuple[_Key, DeviceMesh | None, list[int]]:
    """(stable key, mesh, mesh dims the gradient is sharded over)."""
    if not isinstance(grad, DTensor):
        return ("local",), None, []
    dims = []
    for i, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise RuntimeError("a gradient is still a partial sum; reduce it before measuring its norm")
        if not placement.is_replicate():  # Shard, and FSDP's _StridedShard (not an is_shard() in torch 2.13)
            dims.append(i)
    mesh = grad.device_mesh
    return (mesh.mesh_dim_names, tuple(mesh.mesh.shape), tuple(dims)), mesh, dims


def _sum_of_squares_fp32(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum ||t||^2 accumulated in fp32 whatever the gradients' dtype (bf16 squares lose digits),
    without an fp32 copy of the gradients: the norm kernels upcast as they read."""
    if tensors[0].device.type == "cpu":
        norms = [torch.linalg.vector_norm(t, 2.0, dtype=torch.float32) for t in tensors]
    else:
        norms = list(torch.ops.aten._foreach_norm.Scalar(tensors, 2.0, torch.float32))
    return torch.stack(norms).square().sum()


def total_grad_norm(params: Sequence[torch.Tensor], pp_group: ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model (fp32 scalar on the gradients' device)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    buckets: dict[_Key, tuple[DeviceMesh | None, list[int], list[torch.Tensor]]] = {}
    for g in grads:
        key, mesh, dims = _group_key(g)
        local = g.to_local() if isinstance(g, DTensor) else g
        buckets.setdefault(key, (mesh, dims, []))[2].append(local)
    device = next(iter(buckets.values()))[2][0].device
    total = torch.zeros((), device=device, dtype=torch.float32)
    for mesh, dims, tensors in buckets.values():
        sq = _sum_of_squares_fp32(tensors)
        for dim in dims:
            assert mesh is not None  # a sharded gradient is a DTensor: it has a mesh
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(mesh_dim=dim))
        total = total + sq
    if pp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
    return total.sqrt()


def clip_grad_norm(
    params: Sequence[torch.Tensor], max_norm: float, pp_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (inf = measure only); returns the pre-clip norm.

    Nothing is read on the host: the coefficient ``min(max_norm / (norm + 1e-6), 1)`` stays a
    device scalar and every local shard is scaled by one ``_foreach_mul_`` per device and dtype.
    A non-finite norm gives a non-finite coefficient; the gradients are then already bad and the
    step's NaN policy (or the fp16 gradient scaler) decides what happens to the update.
    """
    norm = total_grad_norm(params, pp_group)
    if not math.isfinite(max_norm):
        return norm
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_kind.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for (device, _), grads in by_kind.items():
            torch._foreach_mul_(grads, coef.to(device))  # pyright: ignore[reportPrivateImportUsage]
    return norm
