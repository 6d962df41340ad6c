"""`build_plan`: will this job fit, and how is it laid out, answered in seconds without a GPU.

The plan builds rank R's model exactly as training would (sharded_model:
the same ``parallelize`` on the meta device, under a fake process group of the job's
world size), so parameter, gradient and optimizer bytes come from the real sharded
DTensors. Activation memory, communication buffers and optimizer-step temporaries are
estimates from the shapes (activations, costs). The peak of a rank is

    parameters + gradients + optimizer state + runtime allowance
      + max(activations + communication buffers, optimizer-step temporaries)

(gradients are counted whole: with accumulation or a pipeline they exist during the
backward of later micro-batches) and it FITS when that is within slurm.gpu_memory_gb.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.parallel.build import compute_dtype
from kforge_cli.engine.plan.activations import (
    ActivationEstimate,
    bubble_fraction,
)
from kforge_cli.engine.plan.cost_model import CostConstants, StepEstimate
from kforge_cli.engine.plan.costs import (
    Throughput,
    kv_gather_bytes,
    throughput,
)
from kforge_cli.engine.plan.memory_items import (
    GIB,
    TIGHT_FRACTION,
    MemoryItem,
    _memory,
    dense_attention_mask,
    peak_of,
)
from kforge_cli.engine.plan.moe_terms import moe_notes
from kforge_cli.engine.plan.sharded_model import (
    MetaBuild,
    StageLayout,
    build_meta,
    fake_process_group,
    target_device,
)
from kforge_cli.engine.runtime.dtypes import dtype_name
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, ParallelDims, resolve_dims

SMALL_MICROBATCH_TOKENS = 4096
BUBBLE_WARNING = 0.2


@dataclass
class ParallelPlan:
    """The plan of one rank of a job (see the module docstring for how the peak is added up)."""

    profile: str | None
    world_size: int
    rank: int
    mesh: dict[str, int]
    coordinates: dict[str, int]
    stages: list[StageLayout]
    rank_stages: list[int]
    total_params: int
    local_params: int
    param_dtype: str
    compute_dtype: str
    memory: list[MemoryItem]
    activations: ActivationEstimate
    peak_bytes: int
    capacity_bytes: int
    throughput: Throughput
    step: StepEstimate | None = None  # the cost model's step (plan.cost_model), the figure every command prints
    constants: CostConstants | None = None
    step_note: str = ""  # why there is no step estimate
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    build_seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def biggest(self) -> MemoryItem:
        return max(self.memory, key=lambda m: m.bytes)

    def item(self, name: str) -> MemoryItem:
        """The memory item called ``name`` (KeyError if absent)."""
        for m in self.memory:
            if m.name == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready view (``kforge plan --format json``)."""
        out = asdict(self)
        out["activations"] = self.activations.as_dict()
        out["step"] = self.step.as_dict() if self.step is not None else None
        out["constants"] = self.constants.as_dict() if self.constants is not None else None
        out["fits"] = self.fits
        out["verdict"] = "FITS" if self.fits else "DOES NOT FIT"
        out["biggest"] = self.biggest.name
        return out


def _warnings(settings: JobSettings, dims: ParallelDims, peak: int, capacity: int) -> list[str]:
    t, d, sl = settings.train, settings.distributed, settings.slurm
    out: list[str] = []
    bubble = bubble_fraction(dims.pp, d.pp_stages_per_rank, t.grad_accum_steps)
    if bubble > BUBBLE_WARNING:
        better = bubble_fraction(dims.pp, d.pp_stages_per_rank, 4 * dims.pp)
        out.append(
            f"pipeline bubble: {bubble:.0%} of each step idles with {t.grad_accum_steps} micro-batches over "
            f"pp={dims.pp}; raise train.grad_accum_steps to {4 * dims.pp} ({better:.0%})"
        )
    if (
        dims.tp > 1
        and dims.world_size > sl.gpus_per_node
        and (dims.tp > sl.gpus_per_node or sl.gpus_per_node % dims.tp)
    ):
        out.append(
            f"tensor parallelism crosses nodes: tp={dims.tp} groups do not fit in {sl.gpus_per_node} GPUs per node; "
            "its per-layer collectives then run over the network (choose tp dividing slurm.gpus_per_node)"
        )
    tokens = t.batch_size * t.seq_len
    if target_device(settings).type == "cuda" and tokens < SMALL_MICROBATCH_TOKENS:
        out.append(
            f"tiny per-GPU batch: {tokens} tokens per micro-batch leave the GPU's matmuls underfed; "
            f"aim for >= {SMALL_MICROBATCH_TOKENS} (train.batch_size x train.seq_len)"
        )
    if capacity and TIGHT_FRACTION * capacity < peak <= capacity:
        out.append(f"tight: the peak is {peak / capacity:.0%} of the GPU; allocator fragmentation may still OOM")
    return out


def _notes(settings: JobSettings, built: MetaBuild, dims: ParallelDims) -> list[str]:
    out: list[str] = []
    if settings.train.float8 and not built.float8_swapped:
        out.append("torchao is not installed: float8 is accounted without its module swap (parameters are unchanged)")
    if settings.vlm is not None:
        out.append("VLM: activations and FLOPs cover the text decoder only (not the vision encoder)")
    if settings.data.document_masking:
        if dense_attention_mask(settings, target_device(settings).type == "cuda"):
            out.append("document masking: dense-mask SDPA, estimated with one additive mask per block")
        else:
            out.append("document masking: FlexAttention block mask (no dense mask is stored)")
    if dims.cp > 1:
        cbytes = compute_dtype(settings, target_device(settings)).itemsize
        kv = kv_gather_bytes(settings, dims, cbytes)
        # Layers of this rank's pipeline stages; K/V of its TP rank's heads; the part of a gathered tensor from peers.
        m, n, share = settings.model, len(built.block_ids), (dims.cp - 1) / dims.cp
        how = f"all-gathers K/V of its {m.kv_heads // dims.tp} KV heads"
        if settings.distributed.cp_attention == "ring":  # K/V repeated to the query heads (kv_gather_bytes)
            how = f"runs torch's ring SDPA, which gathers K/V repeated to its {m.n_heads // dims.tp} query heads"
        out.append(
            f"context parallel cp={dims.cp}: each rank holds 1/{dims.cp} of every sequence; per layer it {how} "
            f"({kv / 2**20:.1f} MiB gathered, {kv * share / 2**20:.1f} MiB from peers) "
            f"and reduce-scatters their gradients in the backward: {2 * n * kv * share / 2**30:.2f} GiB in and out "
            f"per rank per micro-batch over its {n} layers (an activation-checkpointed block gathers again in its "
            "recompute)"
        )
    if dims.pp > 1:
        out.append("pipeline stages differ in memory: check the first and last stage's ranks with --rank")
    return out


def build_plan(settings: JobSettings, world_size: int, rank: int = 0, *, mfu: float | None = None) -> ParallelPlan:
    """The plan of rank ``rank`` of ``settings`` run on ``world_size`` processes; its step time is the
    cost model's (``mfu``: the --mfu override, else ``plan.mfu``, else the GPU table's)."""
    if not 0 <= rank < world_size:
        raise InvalidInputError(f"--rank must be in [0, {world_size - 1}] for world size {world_size} (got {rank})")
    if mfu is not None and not 0 < mfu <= 1:
        raise InvalidInputError(f"--mfu must be in (0, 1] (got {mfu})")
    dims = resolve_dims(settings, world_size)
    start = time.perf_counter()
    with fake_process_group(world_size, rank):
        built = build_meta(settings, dims, rank)
    device = target_device(settings)
    cdtype = compute_dtype(settings, device)
    cbytes = cdtype.itemsize
    items, acts = _memory(settings, dims, built, cbytes)
    peak = peak_of(items)
    capacity = int(settings.slurm.gpu_memory_gb * GIB)
    cname = dtype_name(cdtype)
    step, consts, note = _step(settings, world_size, cname, mfu)
    flops = throughput(settings, dims, cname, consts.mfu if consts is not None else (mfu or 0.4))
    if step is not None:
        flops = replace(flops, step_time_s=step.step_s, tokens_per_s=step.tokens_per_s)
    return ParallelPlan(
        profile=settings.profile,
        world_size=world_size,
        rank=rank,
        mesh={
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            **({"ep": dims.ep} if dims.ep > 1 else {}),  # a split of dp_shard (dp_shard_mod_ep x ep)
            **({"cp": dims.cp} if dims.cp > 1 else {}),  # listed only when used, like the mesh's own dims
            "tp": dims.tp,
        },
        coordinates=built.coordinates,
        stages=built.stages,
        rank_stages=built.rank_stages,
        total_params=sum(p.full_numel for p in built.params) if dims.pp == 1 else _full_model_params(settings),
        local_params=sum(p.local_numel for p in built.params),
        param_dtype=settings.train.master_dtype,
        compute_dtype=cname,
        memory=items,
        activations=acts,
        peak_bytes=peak,
        capacity_bytes=capacity,
        throughput=flops,
        step=step,
        constants=consts,
        step_note=note,
        warnings=_warnings(settings, dims, peak, capacity),
        notes=_notes(settings, built, dims) + moe_notes(settings, built.params, built.block_ids, cbytes),
        build_seconds=time.perf_counter() - start,
    )


def _step(
    settings: JobSettings, world_size: int, compute_dtype_name: str, mfu: float | None
) -> tuple[StepEstimate | None, CostConstants | None, str]:
    """The cost model's step of the settings' own layout, the one ``plan search`` gives it (or why none)."""
    from kforge_cli.engine.plan.cost_model import cost_constants
    from kforge_cli.engine.plan.search import predict_step

    if settings.vlm is not None:
        return None, None, "VLM: the step-time model covers text models (compute of the text decoder only)"
    try:
        consts = cost_constants(settings, compute_dtype_name, mfu)
        return predict_step(settings, world_size, mfu=mfu), consts, ""
    except InvalidInputError as exc:
        return None, None, str(exc)


def _full_model_params(settings: JobSettings) -> int:
    """Parameters of the whole model (a pipeline rank builds only its stages)."""
    return family_for(settings.model).param_count(settings.model)
