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
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.model.attention_mask import resolve_backend
from kforge_cli.engine.parallel.build import compute_dtype
from kforge_cli.engine.parallel.fsdp import resolve_reshard_after_forward
from kforge_cli.engine.plan.activations import (
    ActivationEstimate,
    ActivationInputs,
    bubble_fraction,
    estimate_activations,
    pipeline_in_flight,
)
from kforge_cli.engine.plan.costs import (
    Throughput,
    fsdp_buffers,
    kv_gather_bytes,
    optimizer_state_bytes,
    optimizer_step_temporaries,
    throughput,
    transit_buffers,
)
from kforge_cli.engine.plan.moe import moe_notes
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

GIB = 1024**3
CUDA_RUNTIME_BYTES = 2 * GIB  # CUDA context + NCCL communicators: an allowance, not measured
TIGHT_FRACTION = 0.9  # above this share of the GPU, allocator fragmentation may still OOM
SMALL_MICROBATCH_TOKENS = 4096
BUBBLE_WARNING = 0.2


@dataclass(frozen=True)
class MemoryItem:
    """One line of a rank's memory budget; ``phase`` says when it is alive."""

    name: str
    bytes: int
    phase: str  # "held" (always), "backward" (forward/backward peak), "optimizer" (optimizer step)
    detail: str


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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (``validate-config --plan --format json``)."""
        out = asdict(self)
        out["activations"] = self.activations.as_dict()
        out["fits"] = self.fits
        out["verdict"] = "FITS" if self.fits else "DOES NOT FIT"
        out["biggest"] = self.biggest.name
        return out


def _activation_inputs(settings: JobSettings, dims: ParallelDims, compute_bytes: int, cuda: bool) -> ActivationInputs:
    m, t, d = settings.model, settings.train, settings.distributed
    autocast = dims.world_size == 1 and compute_bytes < 4
    shapes = family_for(m).activation_shapes(m, dims.tp)
    ac = t.activation_checkpointing if t.activation_checkpointing != "selective" else f"selective_{t.ac_selective_mode}"
    return ActivationInputs(
        micro_batch=t.batch_size,
        seq_len=t.seq_len,
        dim=shapes.dim,
        q_dim=shapes.q_dim,
        kv_dim=shapes.kv_dim,
        n_heads=shapes.n_heads,
        ffn=shapes.ffn,
        ffn_local=shapes.ffn_local,
        gated=shapes.gated,
        vocab=m.vocab_size,
        norm=shapes.norm,
        qk_norm=shapes.qk_norm,
        tp=dims.tp,
        sequence_parallel=d.sequence_parallel,
        loss_parallel=d.loss_parallel,
        compute_bytes=compute_bytes,
        autocast=autocast,
        cuda=cuda,
        block_weight_copy_bytes=compute_bytes * shapes.block_linear_weights if autocast else 0,
        loss_chunk=t.loss_chunk_size if dims.tp == 1 else 0,
        document_mask=dense_attention_mask(settings, cuda),
        ac_mode=ac,
        ac_every_n_blocks=t.ac_every_n_blocks,
        cp=dims.cp,
        ring=dims.cp > 1 and d.cp_attention == "ring",
    )


def dense_attention_mask(settings: JobSettings, cuda: bool) -> bool:
    """Attention runs with a dense SDPA mask (not is_causal, nor FlexAttention's block mask):
    document masking, a sliding window (model.gemma3) or context parallelism (local queries,
    gathered keys) with the sdpa kernel."""
    d, g = settings.distributed, settings.model.gemma3
    docs, sharded = settings.data.document_masking, d.cp > 1 and d.cp_attention == "allgather"
    windowed = g is not None and g.sliding_window is not None and settings.model.family == "gemma3"
    device = torch.device("cuda" if cuda else "cpu")
    masked = docs or windowed  # a sliding window is a mask like documents (build_attention_mask)
    return (masked or sharded) and resolve_backend(settings.model.attention, device, masked, sharded) == "sdpa"


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


def param_items(settings: JobSettings, dims: ParallelDims, built: MetaBuild, cbytes: int) -> list[MemoryItem]:
    """The items that follow from the parameters alone (not the micro-batch, AC or schedule)."""
    cuda = target_device(settings).type == "cuda"
    params = built.params
    trainable = [p for p in params if p.trainable]
    t = settings.train
    fp8_gather = t.float8 and cuda and dims.dp_shard > 1 and t.float8_recipe == "tensorwise" and dims.world_size > 1
    gathered, reduce = 0, 0
    if dims.world_size > 1:
        gathered, reduce = fsdp_buffers(
            params,
            compute_bytes=cbytes,
            reshard_after_forward=resolve_reshard_after_forward(settings),
            float8_all_gather=fp8_gather,
        )
    items = [
        MemoryItem("parameters", sum(p.local_bytes for p in params), "held", f"{t.master_dtype} shards"),
        MemoryItem("gradients", sum(p.local_bytes for p in trainable), "held", f"{t.master_dtype} shards"),
        MemoryItem(
            "optimizer state", optimizer_state_bytes(params, settings.optimizer.name), "held", settings.optimizer.name
        ),
        MemoryItem("FSDP buffers", gathered + reduce, "backward", "all-gathered params + reduce-scatter grads"),
        MemoryItem(
            "optimizer step temporaries",
            optimizer_step_temporaries(params, settings, cuda),
            "optimizer",
            "after the backward",
        ),
    ]
    if cuda:
        items.append(MemoryItem("CUDA context + NCCL", CUDA_RUNTIME_BYTES, "held", "allowance"))
    return items


def activation_items(
    settings: JobSettings, dims: ParallelDims, built: MetaBuild, cbytes: int
) -> tuple[list[MemoryItem], ActivationEstimate]:
    """The items that follow from the micro-batch, AC mode and schedule: activations and their transit buffers."""
    cuda = target_device(settings).type == "cuda"
    d, t = settings.distributed, settings.train
    pp_rank = built.coordinates["pp"]
    in_flight = pipeline_in_flight(d.pp_schedule, dims.pp, pp_rank, d.pp_stages_per_rank, t.grad_accum_steps)
    acts = estimate_activations(
        _activation_inputs(settings, dims, cbytes, cuda), built.block_ids, built.has_head, in_flight
    )
    tp, pp, cp = (0, 0, 0)
    if dims.world_size > 1:
        tp, pp, cp = transit_buffers(settings, dims, compute_bytes=cbytes, n_stages_here=len(built.rank_stages))
    ac = t.activation_checkpointing + (f"/{t.ac_selective_mode}" if t.activation_checkpointing == "selective" else "")
    items = [
        MemoryItem(
            "activations",
            acts.peak,
            "backward",
            f"micro-batch {t.batch_size}x{t.seq_len}, AC {ac}, {in_flight:g} in flight",
        ),
        MemoryItem("TP/PP buffers", tp + pp, "backward", "activations in transit"),
    ]
    if dims.cp > 1:
        items.append(MemoryItem("CP K/V gradients", cp, "backward", "one layer's gathered K/V gradient"))
    return items, acts


def _memory(
    settings: JobSettings, dims: ParallelDims, built: MetaBuild, cbytes: int
) -> tuple[list[MemoryItem], ActivationEstimate]:
    held = param_items(settings, dims, built, cbytes)
    transient, acts = activation_items(settings, dims, built, cbytes)
    by_name = {m.name: m for m in held + transient}
    order = ["parameters", "gradients", "optimizer state", "activations", "FSDP buffers", "TP/PP buffers"]
    order += ["CP K/V gradients", "optimizer step temporaries", "CUDA context + NCCL"]
    return [by_name[n] for n in order if n in by_name], acts


def peak_of(items: list[MemoryItem]) -> int:
    """held + max(backward, optimizer): the two phases never overlap."""
    by_phase = {ph: sum(m.bytes for m in items if m.phase == ph) for ph in ("held", "backward", "optimizer")}
    return by_phase["held"] + max(by_phase["backward"], by_phase["optimizer"])


def build_plan(settings: JobSettings, world_size: int, rank: int = 0, *, mfu: float = 0.4) -> ParallelPlan:
    """The plan of rank ``rank`` of ``settings`` run on ``world_size`` processes."""
    if not 0 <= rank < world_size:
        raise InvalidInputError(f"--rank must be in [0, {world_size - 1}] for world size {world_size} (got {rank})")
    if not 0 < mfu <= 1:
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
        throughput=throughput(settings, dims, cname, mfu),
        warnings=_warnings(settings, dims, peak, capacity),
        notes=_notes(settings, built, dims) + moe_notes(settings, built.params, built.block_ids, cbytes),
        build_seconds=time.perf_counter() - start,
    )


def _full_model_params(settings: JobSettings) -> int:
    """Parameters of the whole model (a pipeline rank builds only its stages)."""
    return family_for(settings.model).param_count(settings.model)
