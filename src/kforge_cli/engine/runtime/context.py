"""`RuntimeContext`: rank, device, process group and device mesh, set up once per process."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from kforge_cli.engine.runtime.launcher import LaunchInfo, detect_launch
from kforge_cli.engine.runtime.mesh import build_mesh, dp_mesh, expert_fsdp_mesh, flat_dp_mesh, loss_mesh, sub_mesh
from kforge_cli.engine.runtime.threads import ThreadChoice, choose_threads
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, resolve_dims
from kforge_cli.settings.parallel_dims import ParallelDims
from kforge_cli.settings.shrink import LayoutChoice


@dataclass
class RuntimeContext:
    """Where this process sits: rank, device, and the mesh dims actually used."""

    launch: LaunchInfo
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh | None = None  # dims named pp/dp_replicate/dp_shard(_mod_ep, ep)/cp/tp (engine.runtime.mesh)
    owns_process_group: bool = False  # init_runtime created the process group, so teardown destroys it
    threads: ThreadChoice | None = None  # the CPU thread count chosen for this process, and why (logged once)
    extra: dict[str, object] = field(default_factory=dict)
    # The shrink policy's choice (slurm.min_nodes) when it is on: this job's layout and the run's own settings
    layout_choice: LayoutChoice | None = None

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
        """Data-parallel degree: how many different batches one step processes (excludes tp and pp)."""
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas (TP and PP peers share it, and their batch)."""
        if self.mesh is None:
            return 0
        return flat_dp_mesh(self.mesh).get_local_rank()

    def dp_group(self) -> ProcessGroup | None:
        """The process group over data-parallel ranks (None = single process)."""
        return None if self.mesh is None else flat_dp_mesh(self.mesh).get_group()

    @property
    def cp_size(self) -> int:
        """Context-parallel degree: ranks that split each sequence of one batch."""
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        cp = sub_mesh(self.mesh, "cp")
        return 0 if cp is None else cp.get_local_rank()

    def cp_group(self) -> ProcessGroup | None:
        """The context-parallel group of this rank (None without context parallelism)."""
        cp = sub_mesh(self.mesh, "cp")
        return None if cp is None else cp.get_group()

    @property
    def loss_ranks(self) -> int:
        """Ranks whose label tokens differ (dp x cp): the loss is normalised over all of their tokens."""
        return self.dims.dp * self.dims.cp

    def loss_group(self) -> ProcessGroup | None:
        """The process group over dp x cp ranks, for valid-token counts and loss sums (None = one process)."""
        return None if self.mesh is None else loss_mesh(self.mesh).get_group()

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def pp_rank(self) -> int:
        pp = sub_mesh(self.mesh, "pp")
        return 0 if pp is None else pp.get_local_rank()

    def pp_group(self) -> ProcessGroup | None:
        """The pipeline group of this rank (None without pipeline parallelism)."""
        pp = sub_mesh(self.mesh, "pp")
        return None if pp is None else pp.get_group()

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D tensor-parallel sub-mesh (None without tensor parallelism)."""
        return sub_mesh(self.mesh, "tp")

    def ep_mesh(self) -> DeviceMesh | None:
        """The 1-D expert-parallel sub-mesh (None without expert parallelism)."""
        return sub_mesh(self.mesh, "ep")

    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards routed experts over under EP ((dp_replicate,) dp_shard_mod_ep); None without EP."""
        return None if self.ep_mesh() is None or self.mesh is None else expert_fsdp_mesh(self.mesh)

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over (2-D for HSDP), None in a single process."""
        return None if self.mesh is None else dp_mesh(self.mesh)


def resolve_backend(spec: str, device: torch.device) -> str:
    """The backend string for `init_process_group`, keeping only backends this torch build has.

    ``cpu:gloo,cuda:nccl`` (the default) gives NCCL for GPU tensors and gloo for CPU-side
    coordination (object broadcasts, CPU tensors). On a CPU-only build, and with a CUDA build
    on a machine without a GPU (NCCL refuses to start there), NCCL is dropped, so the same
    settings run the CPU jobs; training on CUDA without NCCL is an error.
    """
    nccl = dist.is_nccl_available() and torch.cuda.is_available()
    available = {"gloo": dist.is_gloo_available(), "nccl": nccl, "mpi": dist.is_mpi_available()}
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) == 1 and ":" not in parts[0]:
        return parts[0]
    kept = []
    for part in parts:
        dev, _, backend = part.partition(":")
        if not available.get(backend, True):
            if dev == device.type:
                raise InvalidInputError(
                    f"distributed.backend {spec!r}: backend {backend!r} for {dev} tensors is not available here "
                    f"(this torch build or this machine lacks it); choose another, e.g. --distributed.backend=cpu:gloo"
                )
            continue
        kept.append(part)
    if not any(p.startswith(f"{device.type}:") for p in kept):
        raise InvalidInputError(f"distributed.backend {spec!r} names no backend for {device.type} tensors")
    return ",".join(kept)


def choose_device(want: str, local_rank: int) -> torch.device:
    """cuda:<local rank> (modulo the visible GPUs, for srun's one-GPU-per-task binding) or cpu,
    as ``want`` (``train.device``: auto, cuda or cpu) asks."""
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise InvalidInputError("train.device = 'cuda' but CUDA is not available; use --train.device=cpu")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) identically on every rank.

    The same seed everywhere is what makes model init identical on every rank (and
    equal to a single-process run, see engine.parallel.init). Randomness that must
    differ per rank uses its own generator from :func:`rank_generator`.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_generator(seed: int, rank: int, device: torch.device) -> torch.Generator:
    """A generator private to ``rank`` (e.g. for dropout or noise), leaving the shared RNG untouched."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + rank) % 2**63)
    return gen


def process_group_timeout_s(settings: JobSettings) -> float:
    """The collectives' timeout: ``distributed.timeout_s``, raised above an explicit
    ``resilience.hang_timeout_s`` so that the hang watchdog fires (stacks, exit 76) before
    a collective times out (an automatic watchdog limit is capped below this instead)."""
    base = float(settings.distributed.timeout_s)
    hang = settings.resilience.hang_timeout_s
    if hang:
        return max(base, hang + max(60.0, 0.25 * hang))
    return base


def init_runtime(settings: JobSettings) -> RuntimeContext:
    """Detect the launcher, pick the device, start the process group and mesh, seed RNGs.

    A process group that already exists (a test harness, a notebook) is used as is and
    left alive at teardown; one created here is destroyed by :func:`teardown_runtime`.
    """
    launch = detect_launch()
    dims = resolve_dims(settings, launch.world_size)
    threads = choose_threads(settings.train.num_threads)
    torch.set_num_threads(threads.threads)
    device = choose_device(settings.train.device, launch.local_rank)
    mesh = None
    owns = False
    if launch.world_size > 1:
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", launch.master_addr)
            os.environ.setdefault("MASTER_PORT", str(launch.master_port))
            dist.init_process_group(
                backend=resolve_backend(settings.distributed.backend, device),
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timedelta(seconds=process_group_timeout_s(settings)),
                device_id=device if device.type == "cuda" else None,
            )
            owns = True
        mesh = build_mesh(device, dims)
    seed_everything(settings.train.seed)
    return RuntimeContext(launch=launch, device=device, dims=dims, mesh=mesh, owns_process_group=owns, threads=threads)


def teardown_runtime(ctx: RuntimeContext) -> None:
    """Destroy the process group (called only after a successful run, and only if we created it).

    After a failure the group is left alone: a rank that fails must not hang in a barrier
    waiting for peers that may be dead; the launcher tears the job down instead.
    """
    if ctx.distributed:
        dist.barrier()
        if ctx.owns_process_group:
            dist.destroy_process_group()


def device_wait(device: torch.device) -> None:
    """Block until `device` has finished the work queued on it (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        torch.accelerator.synchronize(device)


def all_reduce_sum(value: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum a tensor over `group` in place (a no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def all_reduce_max(value: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value
