"""Every rank's parameter shards of any layout, computed from one small template build.

Why: the layout search (``plan.search``) weighs thousands of layouts; the meta build of
``sharded_model`` takes seconds for a 70B model, once per layout and rank. The shards do
not need it: a parameter's local shape follows from its global shape and from *which*
tensor dims TP and EP split, by torch's chunk rule (DTensor ``Shard`` and FSDP2's dim-0
shard both take ``ceil(n / k)``-sized chunks, the last ones shorter or empty):

- ``Shard(d)`` over ``tp`` (column/row-parallel linears, the vocab-parallel embedding and
  head; norms stay whole), ``Shard(0)`` over ``ep`` (routed experts);
- then FSDP2 chunks dim 0 of that local tensor over ``dp_shard x cp`` (routed experts under
  EP: over ``dp_shard / ep``, their own unit); ``dp_replicate`` holds copies.

Which dims TP and EP split is read, not restated: the template is the model with one
block of each kind (dense, MoE) at the real width, parallelised by the real
``parallelize`` on the meta device under a fake process group with ``tp = 2`` (and
``ep = 2``). Blocks of a kind share their parameters' shapes, so the template's blocks
stand for all blocks. tests/unit/test_plan_search.py checks the result against
``sharded_model.build_meta`` parameter by parameter for TP, PP, CP, EP, HSDP and
uneven shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from kforge_cli.engine.families.base import BLOCKS
from kforge_cli.engine.plan.sharded_model import (
    HEAD_NAME,
    MetaBuild,
    ParamShard,
    fake_process_group,
    parallel_modules,
    pipeline_layout,
)
from kforge_cli.engine.runtime.dtypes import DTYPES
from kforge_cli.settings import JobSettings, ParallelDims

TEMPLATE_TP = 2
TEMPLATE_EP = 2


def chunk_size(n: int, parts: int, index: int) -> int:
    """Length of chunk ``index`` of ``torch.chunk`` over ``n`` elements in ``parts`` (0 past the end)."""
    if parts <= 1:
        return n
    full = -(-n // parts)
    return max(0, min(n, full * (index + 1)) - full * index)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the whole model, as TP and EP split it (independent of their sizes)."""

    suffix: str  # the name after ``layers.<i>.`` for a block parameter, else the full name
    shape: tuple[int, ...]
    tp_dim: int | None  # the tensor dim split over ``tp`` (None: whole on every TP rank)
    ep_dim: int | None  # the tensor dim split over ``ep`` (routed experts)
    element_size: int
    trainable: bool
    embedding: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard(self, name: str, dims: ParallelDims, coords: dict[str, int]) -> ParamShard:
        """This parameter as the rank at ``coords`` (mesh coordinates; missing ones are 0) holds it."""
        shape = list(self.shape)
        tp_factor = 1
        if dims.tp > 1 and self.tp_dim is not None:
            shape[self.tp_dim] = chunk_size(shape[self.tp_dim], dims.tp, coords.get("tp", 0))
            tp_factor *= dims.tp
        expert = dims.ep > 1 and self.ep_dim is not None
        if expert:
            assert self.ep_dim is not None
            shape[self.ep_dim] = chunk_size(shape[self.ep_dim], dims.ep, coords.get("ep", 0))
            tp_factor *= dims.ep
        if dims.world_size > 1 and shape:
            if expert:  # their own FSDP unit over dp_shard_mod_ep (replicated over dp_replicate)
                parts, index = dims.dp_shard // dims.ep, coords.get("dp_shard_mod_ep", 0)
            else:  # dp_shard x cp, flattened with dp_shard outer
                parts, index = dims.dp_shard * dims.cp, coords.get("dp_shard", 0) * dims.cp + coords.get("cp", 0)
            shape[0] = chunk_size(shape[0], parts, index)
        local = 1
        for s in shape:
            local *= s
        full = self.numel
        return ParamShard(
            name, local, full, full // tp_factor, self.element_size, len(self.shape), self.trainable, self.embedding
        )


@dataclass(frozen=True)
class RankPlace:
    """Where a pipeline rank sits: its stages, their blocks, whether it has the embedding and the head."""

    stage_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    has_embedding: bool
    has_head: bool


def rank_place(settings: JobSettings, pp_rank: int) -> RankPlace:
    """The :class:`RankPlace` of pipeline rank ``pp_rank`` under ``settings.distributed``."""
    from kforge_cli.engine.parallel.pipeline import stage_ids_of_rank

    d = settings.distributed
    layout = pipeline_layout(settings)
    stage_ids = stage_ids_of_rank(pp_rank, d.pp, d.pp_stages_per_rank, d.pp_schedule) if d.pp > 1 else [0]
    return RankPlace(
        tuple(stage_ids),
        tuple(sorted(i for s in stage_ids for i in layout[s].layers)),
        any(layout[s].embedding for s in stage_ids),
        any(layout[s].head for s in stage_ids),
    )


@dataclass(frozen=True)
class ShardTemplate:
    """The parameters of a model, by place: root ones before the blocks, block ones per kind, root ones after."""

    head_first: tuple[ParamSpec, ...]  # the embedding (first stage)
    blocks: dict[bool, tuple[ParamSpec, ...]]  # is an MoE block -> its parameters in named_parameters order
    tail: tuple[ParamSpec, ...]  # final norm and head (last stage)
    moe_layers: frozenset[int]
    n_layers: int
    _cache: dict[tuple[object, ...], list[ParamShard]] = field(default_factory=dict, compare=False, repr=False)

    def block_kind(self, layer: int) -> bool:
        return layer in self.moe_layers

    def _shards(self, place: str, layer: int, dims: ParallelDims, where: dict[str, int]) -> list[ParamShard]:
        """The shards of block ``layer`` (``place`` "block"), or of the root's first/tail parameters (cached)."""
        key = (place, layer, dims.tp, dims.ep, dims.dp_shard, dims.cp, dims.world_size > 1, *sorted(where.items()))
        found = self._cache.get(key)
        if found is None:
            if place == "block":
                specs, prefix = self.blocks[self.block_kind(layer)], f"layers.{layer}."
            else:
                specs, prefix = (self.head_first if place == "first" else self.tail), ""
            found = self._cache[key] = [p.shard(prefix + p.suffix, dims, where) for p in specs]
        return found

    def build(
        self, settings: JobSettings, dims: ParallelDims, pp_rank: int, coords: dict[str, int] | None = None
    ) -> MetaBuild:
        """The :class:`MetaBuild` (parameters and place) of the rank at pipeline rank ``pp_rank`` and ``coords``."""
        from kforge_cli.engine.parallel.pipeline import stage_ids_of_rank

        where = {k: v for k, v in (coords or {}).items() if k != "pp" and v}
        d = settings.distributed
        layout = pipeline_layout(settings)
        stage_ids = stage_ids_of_rank(pp_rank, dims.pp, d.pp_stages_per_rank, d.pp_schedule) if dims.pp > 1 else [0]
        params: list[ParamShard] = []
        for sid in stage_ids:
            st = layout[sid]
            if st.embedding:
                params += self._shards("first", 0, dims, where)
            for i in st.layers:
                params += self._shards("block", i, dims, where)
            if st.head:
                params += self._shards("tail", 0, dims, where)
        names = ("pp", "dp_replicate", "dp_shard", *(("cp",) if dims.cp > 1 else ()), "tp")
        place = {"pp": pp_rank, **where}
        return MetaBuild(
            params=params,
            coordinates={n: place.get(n, 0) for n in names},
            stages=layout,
            rank_stages=stage_ids,
            block_ids=sorted(i for s in stage_ids for i in layout[s].layers),
            has_embedding=any(layout[s].embedding for s in stage_ids),
            has_head=any(layout[s].head for s in stage_ids),
            float8_swapped=False,
        )

    def held_lower_bound(self, dims: ParallelDims, state_slots: int) -> float:
        """A lower bound of the largest (parameters + gradients + optimizer state) of any pipeline rank.

        Every rank's chunk 0 is at least the average chunk, and the busiest pipeline rank
        holds at least the average stage: so the whole model over the splits, over ``pp``.
        """
        total = 0.0
        specs = [*self.head_first, *self.tail]
        for i in range(self.n_layers):
            specs += self.blocks[self.block_kind(i)]
        for p in specs:
            parts = dims.tp if dims.tp > 1 and p.tp_dim is not None else 1
            if dims.ep > 1 and p.ep_dim is not None:
                parts *= dims.ep * (dims.dp_shard // dims.ep)
            elif dims.world_size > 1:
                parts *= dims.dp_shard * dims.cp
            total += p.numel * p.element_size / parts
        return total * (2 + state_slots) / dims.pp


def _split_dims(param: torch.Tensor) -> tuple[int | None, int | None]:
    """(the dim sharded over the ``tp`` mesh dim, the one over ``ep``) of a template parameter."""
    if not isinstance(param, DTensor):
        return None, None
    names = param.device_mesh.mesh_dim_names or ()
    found: dict[str, int] = {}
    for name, placement in zip(names, param.placements, strict=True):
        if name in ("tp", "ep") and isinstance(placement, Shard):
            found[name] = placement.dim
    return found.get("tp"), found.get("ep")


def template_settings(settings: JobSettings) -> tuple[JobSettings, ParallelDims, dict[bool, int]]:
    """The template's settings (one block of each kind), its mesh, and the template layer of each kind."""
    m = settings.model
    kinds: dict[bool, int] = {}
    for i in range(m.n_layers):
        kind = m.moe.is_moe_layer(i) if m.moe is not None else False
        kinds.setdefault(kind, i)
        if len(kinds) == 2:
            break
    n_layers = max(kinds.values()) + 1
    ep = TEMPLATE_EP if m.moe is not None and m.moe.num_experts % TEMPLATE_EP == 0 else 1
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=ep, tp=TEMPLATE_TP, cp=1, ep=ep)
    dist = settings.distributed.model_copy(
        update={"tp": TEMPLATE_TP, "ep": ep, "dp_shard": ep, "dp_replicate": 1, "pp": 1, "cp": 1}
    )
    train = settings.train.model_copy(update={"float8": False, "compile_model": False})
    model = m.model_copy(update={"n_layers": n_layers})
    return settings.model_copy(update={"model": model, "distributed": dist, "train": train}), dims, kinds


def build_template(settings: JobSettings) -> ShardTemplate:
    """Parallelise the one-block-per-kind model on meta (see the module docstring) and read its parameters."""
    t_settings, t_dims, kinds = template_settings(settings)
    with fake_process_group(t_dims.world_size, 0):
        modules, _, _, _ = parallel_modules(t_settings, t_dims, 0)
        (module,) = modules
        embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
        size = DTYPES[settings.train.master_dtype].itemsize
        first: list[ParamSpec] = []
        tail: list[ParamSpec] = []
        blocks: dict[bool, list[ParamSpec]] = {kind: [] for kind in kinds}
        layer_kind = {str(i): kind for kind, i in kinds.items()}
        seen: set[int] = set()
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            tp_dim, ep_dim = _split_dims(p)
            parts = name.split(".")
            block = parts[0] == BLOCKS
            spec = ParamSpec(
                suffix=".".join(parts[2:]) if block else name,
                shape=tuple(p.shape),
                tp_dim=tp_dim,
                ep_dim=ep_dim,
                element_size=size,
                trainable=p.requires_grad,
                embedding=id(p) in embeddings or "embeddings" in name,
            )
            if block:
                if parts[1] in layer_kind:
                    blocks[layer_kind[parts[1]]].append(spec)
            elif blocks and any(blocks.values()):
                tail.append(spec)
            else:
                first.append(spec)
    m = settings.model
    moe = frozenset(i for i in range(m.n_layers) if m.moe is not None and m.moe.is_moe_layer(i))
    return ShardTemplate(tuple(first), {k: tuple(v) for k, v in blocks.items()}, tuple(tail), moe, m.n_layers)


__all__ = ["HEAD_NAME", "ParamSpec", "ShardTemplate", "build_template", "chunk_size"]
