"""The memory items of one rank's plan (parameters, gradients, optimizer state, activations, buffers):
what both the plan (planner.py) and the layout search (search.py) add up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.model.attention_mask import resolve_backend
from kforge_cli.engine.parallel.fsdp import resolve_reshard_after_forward
from kforge_cli.engine.plan.activations import (
    ActivationEstimate,
    ActivationInputs,
    estimate_activations,
    pipeline_in_flight,
)
from kforge_cli.engine.plan.costs import (
    fsdp_buffers,
    optimizer_state_bytes,
    optimizer_step_temporaries,
    transit_buffers,
)
from kforge_cli.engine.plan.sharded_model import (
    MetaBuild,
    target_device,
)
from kforge_cli.settings import JobSettings, ParallelDims

GIB = 1024**3

CUDA_RUNTIME_BYTES = 2 * GIB  # CUDA context + NCCL communicators: an allowance, not measured

TIGHT_FRACTION = 0.9  # above this share of the GPU, allocator fragmentation may still OOM


@dataclass(frozen=True)
class MemoryItem:
    """One line of a rank's memory budget; ``phase`` says when it is alive."""

    name: str
    bytes: int
    phase: str  # "held" (always), "backward" (forward/backward peak), "optimizer" (optimizer step)
    detail: str


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
