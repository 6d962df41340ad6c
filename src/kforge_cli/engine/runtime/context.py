"""`RuntimeContext`: rank, device, process group and device mesh, set up once per process."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kforge_cli.engine.runtime.launcher import LaunchInfo, detect_launch
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, ParallelDims, resolve_dims


@dataclass
class RuntimeContext:
    """Where this process sits: rank, device, and the mesh dims actually used."""

    launch: LaunchInfo
    device: torch.device
    dims: ParallelDims
    mesh: Any = None  # torch DeviceMesh with dims named pp/dp_replicate/dp_shard/tp (only those > 1)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas (ranks sharing a batch share it)."""
        if self.mesh is None:
            return 0
        names = self.mesh.mesh_dim_names or ()
        rank, size = 0, 1
        for dim in ("dp_replicate", "dp_shard"):
            if dim in names:
                sub = self.mesh[dim]
                rank = rank * sub.size() + sub.get_local_rank()
                size *= sub.size()
        return rank

    def dp_group(self) -> Any:
        """The process group over data-parallel ranks (None = default group / single process)."""
        if self.mesh is None:
            return None
        names = [n for n in ("dp_replicate", "dp_shard") if n in (self.mesh.mesh_dim_names or ())]
        if not names:
            return None
        if len(names) == 1:
            return self.mesh[names[0]].get_group()
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()


def choose_device(settings: JobSettings, local_rank: int) -> torch.device:
    want = settings.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise InvalidInputError("train.device = 'cuda' but CUDA is not available; use --train.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) identically on every rank.

    Model init must be identical on every rank; per-rank randomness (dropout, none yet)
    would fold the rank into a separate generator.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def init_runtime(settings: JobSettings) -> RuntimeContext:
    """Detect the launcher, pick the device, start the process group and mesh, seed RNGs."""
    launch = detect_launch()
    dims = resolve_dims(settings, launch.world_size)
    if settings.train.num_threads:
        torch.set_num_threads(settings.train.num_threads)
    device = choose_device(settings, launch.local_rank)
    mesh = None
    if launch.world_size > 1:
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        if not dist.is_initialized():
            dist.init_process_group(
                backend=settings.distributed.backend,
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timedelta(seconds=settings.distributed.timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
        mesh = build_mesh(device, dims)
    seed_everything(settings.train.seed)
    return RuntimeContext(launch=launch, device=device, dims=dims, mesh=mesh)


def build_mesh(device: torch.device, dims: ParallelDims) -> Any:
    """A DeviceMesh over the dims > 1, in the order pp, dp_replicate, dp_shard, tp (tp innermost)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = [(n, s) for n, s in (("pp", dims.pp), ("dp_replicate", dims.dp_replicate),
                                   ("dp_shard", dims.dp_shard), ("tp", dims.tp)) if s > 1]  # fmt: skip
    if not shape:
        shape = [("dp_shard", 1)]
    return init_device_mesh(device.type, tuple(s for _, s in shape), mesh_dim_names=tuple(n for n, _ in shape))


def teardown_runtime(ctx: RuntimeContext) -> None:
    """Destroy the process group (called only after a successful run)."""
    if ctx.distributed:
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum a tensor over `group` in place (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def all_reduce_max(value: torch.Tensor, group: Any = None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value
