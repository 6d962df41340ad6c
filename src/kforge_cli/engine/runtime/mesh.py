"""The device mesh: named dims ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (outer to inner).

``tp`` is innermost so a tensor-parallel group is made of neighbouring ranks (the GPUs
of one node, joined by NVLink); ``pp`` is outermost so pipeline neighbours may sit on
different nodes (their traffic is one activation per micro-batch).

In a multi-process job ``dp_shard`` is always a mesh dim, even of size 1: FSDP2 is then
applied on every multi-process run, which gives one code path for mixed precision
(FSDP2's ``MixedPrecisionPolicy``), for gradient clipping (every parameter is a DTensor)
and for checkpoints. Other dims appear only when larger than 1.
"""

from __future__ import annotations

from typing import Any

import torch

from kforge_cli.settings import ParallelDims

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")


def mesh_shape(dims: ParallelDims) -> list[tuple[str, int]]:
    """(name, size) of the dims the mesh will have, outer to inner."""
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp}
    return [(name, sizes[name]) for name in MESH_ORDER if sizes[name] > 1 or name == "dp_shard"]


def build_mesh(device: torch.device, dims: ParallelDims) -> Any:
    """A DeviceMesh over ``mesh_shape(dims)``, plus the flattened ``dp`` dim when both dp dims exist."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(dims)
    mesh = init_device_mesh(device.type, tuple(s for _, s in shape), mesh_dim_names=tuple(n for n, _ in shape))
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        # One group over all data-parallel ranks, for token counts and loss sums.
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def has_dim(mesh: Any, name: str) -> bool:
    return mesh is not None and name in (mesh.mesh_dim_names or ())


def dp_mesh(mesh: Any) -> Any:
    """The sub-mesh FSDP2 shards over: 2-D (dp_replicate, dp_shard) = HSDP, else 1-D dp_shard."""
    if has_dim(mesh, "dp_replicate"):
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def flat_dp_mesh(mesh: Any) -> Any:
    """A 1-D mesh over every data-parallel rank (the flattened dp dims)."""
    if has_dim(mesh, "dp_replicate"):
        return mesh["dp"]
    return mesh["dp_shard"]


def sub_mesh(mesh: Any, name: str) -> Any:
    """The 1-D sub-mesh of dim ``name``, or None when the mesh does not have it (size 1)."""
    return mesh[name] if has_dim(mesh, name) else None
