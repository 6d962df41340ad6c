"""Build one rank's parallelised model on the meta device under a fake process group.

Why: the per-rank parameter, gradient and optimizer bytes of a plan must be those of the
real build (TP placements, the pipeline stage split, FSDP2's uneven dim-0 shards, norms
replicated over TP), not a formula that drifts from it. torch's ``fake`` backend gives a
process group of any world size in one process without communicating, so the same
``parallelize`` as training runs on meta tensors and every parameter's local shard shape
is read from its DTensor. Nothing is materialised: ``to_empty``/``init_weights`` are
skipped, and only this rank's pipeline stages are built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from kforge_cli.engine.families.base import BLOCKS, HEAD
from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.parallel.build import parallelize
from kforge_cli.engine.parallel.pipeline import (
    build_stage_module,
    stage_ids_of_rank,
    stage_layer_ids,
    stage_owner,
)
from kforge_cli.engine.runtime import LaunchInfo, RuntimeContext, build_mesh
from kforge_cli.engine.runtime.dtypes import DTYPES
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, ParallelDims

HEAD_NAME = f"{HEAD}.weight"  # the family protocol: the head module is HEAD (families.base)


@dataclass(frozen=True)
class ParamShard:
    """One parameter as this rank holds it."""

    name: str
    local_numel: int  # elements of this rank's shard (``to_local()``)
    full_numel: int  # elements of the whole parameter
    tp_numel: int  # elements on this TP rank before data-parallel sharding (what FSDP all-gathers)
    element_size: int
    ndim: int
    trainable: bool
    embedding: bool  # an nn.Embedding weight or named *embeddings* (Muon leaves it to AdamW)

    @property
    def local_bytes(self) -> int:
        return self.local_numel * self.element_size

    @property
    def is_head(self) -> bool:
        return self.name == HEAD_NAME or self.name.endswith("." + HEAD_NAME)

    @property
    def unit(self) -> str:
        """The FSDP unit holding it: ``layers.<i>`` for a block, ``root`` for the rest."""
        parts = self.name.split(".")
        if len(parts) > 1 and parts[0] == BLOCKS:
            return f"{BLOCKS}.{parts[1]}"
        return "root"


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: its owner and blocks."""

    stage: int
    pp_rank: int
    layers: list[int]
    embedding: bool
    head: bool


@dataclass
class MetaBuild:
    """This rank's parallelised meta model and where it sits."""

    params: list[ParamShard]
    coordinates: dict[str, int]
    stages: list[StageLayout]
    rank_stages: list[int]
    block_ids: list[int]  # global indices of the blocks this rank holds
    has_embedding: bool
    has_head: bool
    float8_swapped: bool


@contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks, seen from ``rank``, that never communicates."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise InvalidInputError(
            "the plan needs its own (fake) process group: run validate-config --plan outside a distributed job"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def target_device(settings: JobSettings) -> torch.device:
    """The device the job will train on: train.device, with auto = cuda unless slurm.gpu_type is cpu."""
    want = settings.train.device
    if want == "auto":
        want = "cpu" if settings.slurm.gpu_type.lower() == "cpu" else "cuda"
    return torch.device("cuda", 0) if want == "cuda" else torch.device("cpu")


def float8_available() -> bool:
    """torchao is importable (the float8 module swap can run)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def _plan_settings(settings: JobSettings, float8: bool) -> JobSettings:
    """The settings the meta build runs with: no torch.compile (it changes no parameter), float8 if possible."""
    train = settings.train.model_copy(update={"compile_model": False, "float8": float8})
    return settings.model_copy(update={"train": train})


def _runtime(settings: JobSettings, dims: ParallelDims, rank: int, device: torch.device) -> RuntimeContext:
    world = dims.world_size
    local = rank % settings.slurm.gpus_per_node
    launch = LaunchInfo("torchrun" if world > 1 else "single", rank, local, world, "127.0.0.1", 0)
    # The mesh lives on the fake backend's CPU side; ``device`` only decides dtypes, as in training.
    mesh = build_mesh(torch.device("cpu"), dims) if world > 1 else None
    return RuntimeContext(launch=launch, device=device, dims=dims, mesh=mesh)


def _coordinates(runtime: RuntimeContext) -> dict[str, int]:
    names = ("pp", "dp_replicate", "dp_shard", *(("cp",) if runtime.cp_size > 1 else ()), "tp")
    if runtime.mesh is None:
        return dict.fromkeys(names, 0)
    dim_names: tuple[str, ...] = tuple(runtime.mesh.mesh_dim_names or ())
    coords: dict[str, int] = dict(zip(dim_names, runtime.mesh.get_coordinate() or (), strict=False))
    return {n: int(coords.get(n, 0)) for n in names}


def pipeline_layout(settings: JobSettings) -> list[StageLayout]:
    """Every pipeline stage: owner pp rank and blocks (one stage of all blocks without PP)."""
    d, n_layers = settings.distributed, settings.model.n_layers
    n_stages = d.pp * d.pp_stages_per_rank if d.pp > 1 else 1
    layers = stage_layer_ids(n_layers, n_stages)
    return [
        StageLayout(s, stage_owner(s, d.pp, d.pp_schedule) if d.pp > 1 else 0, layers[s], s == 0, s == n_stages - 1)
        for s in range(n_stages)
    ]


def _tp_factor(param: DTensor) -> int:
    """How many ways the TP (or EP: routed experts) mesh dim splits ``param`` (1 when replicated over
    it or without it): FSDP never gathers over these dims."""
    names = param.device_mesh.mesh_dim_names or ()
    factor = 1
    for name, placement in zip(names, param.placements, strict=True):
        if name in ("tp", "ep") and isinstance(placement, Shard):
            factor *= param.device_mesh.size(names.index(name))
    return factor


def read_shards(modules: list[nn.Module]) -> list[ParamShard]:
    """Every parameter of ``modules`` (tied ones once) with its local shard size."""
    embeddings = {id(m.weight) for mod in modules for m in mod.modules() if isinstance(m, nn.Embedding)}
    seen: set[int] = set()
    out: list[ParamShard] = []
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = p.to_local() if isinstance(p, DTensor) else p
            tp_numel = p.numel() // _tp_factor(p) if isinstance(p, DTensor) else p.numel()
            embedding = id(p) in embeddings or "embeddings" in name
            out.append(
                ParamShard(
                    name, local.numel(), p.numel(), tp_numel, local.element_size(), p.ndim, p.requires_grad, embedding
                )
            )
    return out


def _meta_modules(settings: JobSettings, runtime: RuntimeContext, stage_ids: list[int]) -> list[nn.Module]:
    d = settings.distributed
    if d.pp > 1:
        layout = pipeline_layout(settings)
        return [
            build_stage_module(settings.model, layout[s].layers, first=layout[s].embedding, last=layout[s].head)
            for s in stage_ids
        ]
    with torch.device("meta"):
        if settings.vlm is not None:
            from kforge_cli.engine.model.vlm import build_vlm

            return [build_vlm(settings)]
        return [family_for(settings.model).build(settings.model)]


def parallel_modules(
    settings: JobSettings, dims: ParallelDims, rank: int
) -> tuple[list[nn.Module], RuntimeContext, list[int], bool]:
    """Rank ``rank``'s modules parallelised on meta as build_parallel_model does: (modules, runtime, its
    stage ids, whether float8 was swapped in). Call inside :func:`fake_process_group` above world size one."""
    swap = settings.train.float8 and float8_available()
    plan_settings = _plan_settings(settings, swap)
    runtime = _runtime(plan_settings, dims, rank, target_device(settings))
    d = settings.distributed
    stage_ids = stage_ids_of_rank(runtime.pp_rank, d.pp, d.pp_stages_per_rank, d.pp_schedule) if d.pp > 1 else [0]
    modules = _meta_modules(plan_settings, runtime, stage_ids)
    for module in modules:
        parallelize(module, plan_settings, runtime)
        if runtime.world_size == 1 and settings.train.master_dtype != "fp32":
            module.to(DTYPES[settings.train.master_dtype])  # what the single-process build does after init
    return modules, runtime, stage_ids, swap


def build_meta(settings: JobSettings, dims: ParallelDims, rank: int) -> MetaBuild:
    """Parallelise rank ``rank``'s modules on meta, as build_parallel_model does, and read their shards.

    Call inside :func:`fake_process_group` when the world size is above one.
    """
    modules, runtime, stage_ids, swap = parallel_modules(settings, dims, rank)
    layout = pipeline_layout(settings)
    blocks = sorted(i for s in stage_ids for i in layout[s].layers)
    return MetaBuild(
        params=read_shards(modules),
        coordinates=_coordinates(runtime),
        stages=layout,
        rank_stages=stage_ids,
        block_ids=blocks,
        has_embedding=any(layout[s].embedding for s in stage_ids),
        has_head=any(layout[s].head for s in stage_ids),
        float8_swapped=swap,
    )
