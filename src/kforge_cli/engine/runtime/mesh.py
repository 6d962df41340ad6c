"""The device mesh: named dims ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (outer to inner).

``tp`` is innermost so a tensor-parallel group is made of neighbouring ranks (the GPUs
of one node, joined by NVLink); ``pp`` is outermost so pipeline neighbours may sit on
different nodes (their traffic is one activation per micro-batch). ``cp`` (context parallel:
ranks that split one sequence, all-gathering K/V per layer) sits next to ``tp``, inside a node
where it fits.

Context-parallel ranks hold the same parameters and see the same batch (each a part of
every sequence), so FSDP2 shards over ``dp_shard x cp`` (flattened ``dp_shard_cp``) and the
loss's token counts are summed over ``dp x cp`` (``dp_cp``); the data loader partitions by
the data-parallel dims only.

Expert parallelism (``ep`` > 1, MoE only) splits ``dp_shard`` into two real dims,
``dp_shard_mod_ep`` (outer) then ``ep`` (inner, so an EP group is made of neighbouring
ranks, where its all-to-alls are cheapest), and ``dp_shard`` becomes their flattened dim:
the mesh is then ``pp, dp_replicate, dp_shard_mod_ep, ep, cp, tp``. Dense parameters are
still sharded over all of ``dp_shard``; routed experts are split ``Shard(0)`` over ``ep`` and
FSDP-sharded over ``dp_shard_mod_ep`` (x ``dp_replicate``), see ``engine.parallel.expert_parallel``.

In a multi-process job ``dp_shard`` is always a mesh dim, even of size 1: FSDP2 is then
applied on every multi-process run, which gives one code path for mixed precision
(FSDP2's ``MixedPrecisionPolicy``), for gradient clipping (every parameter is a DTensor)
and for checkpoints. Other dims appear only when larger than 1.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from kforge_cli.settings.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def mesh_shape(dims: ParallelDims) -> list[tuple[str, int]]:
    """(name, size) of the dims the mesh will have, outer to inner (``dp_shard`` split in two under EP)."""
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp}
    shape = [(name, sizes[name]) for name in MESH_ORDER if sizes[name] > 1 or name == "dp_shard"]
    ep = getattr(dims, "ep", 1)
    if ep > 1:
        i = [n for n, _ in shape].index("dp_shard")
        shape[i : i + 1] = [("dp_shard_mod_ep", dims.dp_shard // ep), ("ep", ep)]
    return shape


def build_mesh(device: torch.device, dims: ParallelDims) -> DeviceMesh:
    """A DeviceMesh over ``mesh_shape(dims)``, plus flattened dims: ``dp`` when both dp dims exist;
    with ``cp``, ``dp_shard_cp`` (FSDP's shard dim) and, with ``dp_replicate``, ``dp_cp``; with
    ``ep``, ``dp_shard`` (over ``dp_shard_mod_ep x ep``)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(dims)
    if device.type == "cpu":  # kforge initialises sharded weights on a CPU mesh by design: torch's note is noise
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
    mesh = init_device_mesh(device.type, tuple(s for _, s in shape), mesh_dim_names=tuple(n for n, _ in shape))
    shard_dims: tuple[str, ...] = ("dp_shard",)
    if has_dim(mesh, "ep"):
        shard_dims = ("dp_shard_mod_ep", "ep")
        mesh[shard_dims]._flatten("dp_shard")
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        # One group over all data-parallel ranks, for token counts and loss sums.
        mesh[("dp_replicate", *shard_dims)]._flatten("dp")
    if has_dim(mesh, "cp"):
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if has_dim(mesh, "dp_replicate"):
            mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return mesh


def has_dim(mesh: DeviceMesh | None, name: str) -> bool:
    return mesh is not None and name in (mesh.mesh_dim_names or ())


def _flat(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """``mesh[names]`` where a name is a flattened dim: torch 2.13 warns that slicing one from the
    root mesh "will be deprecated"; it still works, and kforge's helpers are the only place it happens."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
        return mesh[names[0]] if len(names) == 1 else mesh[names]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh FSDP2 shards over: 2-D (dp_replicate, dp_shard) = HSDP, else 1-D dp_shard;
    with context parallelism, dp_shard_cp in place of dp_shard (CP ranks share parameter shards)."""
    shard = "dp_shard_cp" if has_dim(mesh, "cp") else "dp_shard"
    if has_dim(mesh, "dp_replicate"):
        return _flat(mesh, "dp_replicate", shard)
    return _flat(mesh, shard)


def flat_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over every data-parallel rank (the flattened dp dims)."""
    if has_dim(mesh, "dp_replicate"):
        return _flat(mesh, "dp")
    return _flat(mesh, "dp_shard")


def expert_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards routed experts over under EP: (dp_replicate,) dp_shard_mod_ep."""
    if has_dim(mesh, "dp_replicate"):
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    return mesh["dp_shard_mod_ep"]


def loss_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over every rank whose loss tokens differ (dp x cp): token counts and loss sums."""
    if not has_dim(mesh, "cp"):
        return flat_dp_mesh(mesh)
    return _flat(mesh, "dp_cp" if has_dim(mesh, "dp_replicate") else "dp_shard_cp")


def sub_mesh(mesh: DeviceMesh | None, name: str) -> DeviceMesh | None:
    """The 1-D sub-mesh of dim ``name``, or None when the mesh does not have it (size 1)."""
    return mesh[name] if mesh is not None and has_dim(mesh, name) else None
