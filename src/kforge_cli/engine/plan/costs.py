"""The per-rank costs of a plan that follow from the built shards: optimizer state,
communication buffers, optimizer-step temporaries, FLOPs and throughput, and warnings.

Optimizer state mirrors engine.train's optimizers without importing them (layer 2 may
not import layer 4): AdamW keeps ``exp_avg`` and ``exp_avg_sq`` in the parameter's
dtype plus a 4-byte ``step`` per parameter; Lion keeps ``exp_avg``; Muon keeps a
``momentum_buffer`` for 2-D weights that are neither embeddings nor the output head
(``build_param_groups(muon=True)``) and AdamW state for the rest. Only trainable
parameters get state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.observe.mfu import peak_flops
from kforge_cli.engine.plan.sharded_model import ParamShard
from kforge_cli.settings import JobSettings, ParallelDims
from kforge_cli.settings.training import ModelSettings

STEP_BYTES = 4  # torch.optim.AdamW and Muon's AdamW groups keep `step` as an fp32 scalar tensor
FP32 = 4
_T = 1e12


def muon_managed(p: ParamShard) -> bool:
    """Muon's rule (engine.train.optim.optimizer.build_param_groups): 2-D, not an embedding, not the head."""
    return p.ndim == 2 and not p.embedding and not p.is_head


def optimizer_slots(p: ParamShard, optimizer: str) -> tuple[int, bool]:
    """(state tensors shaped like ``p``, whether ``p`` also has a step counter)."""
    if optimizer == "lion" or (optimizer == "muon" and muon_managed(p)):
        return 1, False
    return 2, True


def optimizer_state_bytes(params: Iterable[ParamShard], optimizer: str) -> int:
    """Bytes of optimizer state this rank holds (state has the dtype and sharding of its parameter)."""
    total = 0
    for p in params:
        if p.trainable:
            slots, step = optimizer_slots(p, optimizer)
            total += slots * p.local_bytes + (STEP_BYTES if step else 0)
    return total


MUON_ROUND_BYTES = 64 * 2**20  # engine.train.optim.muon_distributed.ROUND_BYTES (a test keeps them equal)


def optimizer_step_temporaries(params: list[ParamShard], settings: JobSettings, cuda: bool) -> int:
    """Transient bytes of one optimizer step (after the backward, so never on top of activations).

    foreach AdamW builds ``sqrt(exp_avg_sq)`` for every parameter at once; the fused
    kernel (CUDA) builds nothing. Lion's per-parameter ``lerp`` needs one parameter-sized
    temporary. Muon runs Newton-Schulz on full matrices: split over the ranks (an owner holds a
    round of them), or, with ``optimizer.muon_distributed = false`` or unsharded matrices, each
    gathered on every rank.
    """
    trainable = [p for p in params if p.trainable]
    if not trainable:
        return 0
    opt = settings.optimizer
    largest_local = max(p.local_bytes for p in trainable)
    if opt.name == "adamw":
        fused = opt.fused if opt.fused is not None else cuda
        return 0 if fused else sum(p.local_bytes for p in trainable)
    if opt.name == "lion":
        return largest_local
    managed = [p for p in trainable if muon_managed(p)]
    largest = max((p.full_numel * p.element_size for p in managed), default=0)
    if opt.muon_distributed and any(p.local_numel < p.full_numel for p in managed):
        # split over the ranks (engine.train.optim.muon_distributed): an owner's round of full
        # matrices and their results, 2 x B with B = max(round bytes, largest matrix) but no more
        # than its share of all the matrices, then Newton-Schulz's iterate, Gram matrix and
        # polynomial on one matrix
        ranks = max(p.full_numel // max(p.local_numel, 1) for p in managed)
        share = sum(p.full_numel * p.element_size for p in managed) // ranks + largest
        round_bytes = min(max(MUON_ROUND_BYTES, largest), share)
        return 2 * round_bytes + 3 * largest + largest_local
    return 4 * largest + largest_local  # each matrix gathered whole: its input, the iterate, Gram, polynomial


@dataclass(frozen=True)
class CommBuffers:
    """Communication buffers of one rank at the peak of the backward."""

    fsdp_all_gather: int  # unsharded parameters (compute dtype): the root, the current and the prefetched block
    fsdp_reduce_scatter: int  # unsharded gradients: the root's (until the end), one block's and its fp32 copy
    tensor_parallel: int  # one all-gathered activation in flight
    pipeline: int  # send/receive buffers of activations and gradients per stage
    context_parallel: int = 0  # gradients of one layer's gathered K/V, reduce-scattered over the CP group

    @property
    def total(self) -> int:
        return (
            self.fsdp_all_gather
            + self.fsdp_reduce_scatter
            + self.tensor_parallel
            + self.pipeline
            + self.context_parallel
        )


def comm_buffers(
    params: list[ParamShard],
    settings: JobSettings,
    dims: ParallelDims,
    *,
    compute_bytes: int,
    reshard_after_forward: bool,
    float8_all_gather: bool,
    n_stages_here: int,
) -> CommBuffers:
    """FSDP2 / TP / PP / CP buffers of this rank (:func:`fsdp_buffers` + :func:`transit_buffers`)."""
    if dims.world_size == 1:
        return CommBuffers(0, 0, 0, 0)
    gathered, reduce = fsdp_buffers(
        params,
        compute_bytes=compute_bytes,
        reshard_after_forward=reshard_after_forward,
        float8_all_gather=float8_all_gather,
    )
    tp, pp, cp = transit_buffers(settings, dims, compute_bytes=compute_bytes, n_stages_here=n_stages_here)
    return CommBuffers(gathered, reduce, tp, pp, cp)


def fsdp_buffers(
    params: list[ParamShard], *, compute_bytes: int, reshard_after_forward: bool, float8_all_gather: bool
) -> tuple[int, int]:
    """FSDP2's all-gathered parameters and unsharded gradients at the peak of the backward (multi-process).

    FSDP2 never reshards the root unit (embedding, final norm, head) between forward and
    backward; each block is gathered before its forward and backward with the next one
    prefetched, or, with ``reshard_after_forward`` off (the pipeline default), every block
    stays gathered from its forward to its backward. A unit's gradients are reduced (in
    fp32) after its backward, so the root's unsharded gradients, made first by the head,
    live through the whole backward.
    """
    units: dict[str, int] = defaultdict(int)
    for p in params:
        units[p.unit] += p.tp_numel
    root = units.pop("root", 0)
    blocks = list(units.values()) or [0]
    block_bytes = 1 if float8_all_gather else compute_bytes  # float8 linears are all-gathered in float8
    gathered = root * compute_bytes + (2 * max(blocks) if reshard_after_forward else sum(blocks)) * block_bytes
    reduce_bytes = compute_bytes + (FP32 if compute_bytes < FP32 else 0)
    reduce = root * compute_bytes + max(blocks) * reduce_bytes
    return gathered, reduce


def transit_buffers(
    settings: JobSettings, dims: ParallelDims, *, compute_bytes: int, n_stages_here: int
) -> tuple[int, int, int]:
    """(TP, PP, CP) buffers of activations in transit (multi-process): one micro-batch's activation
    as it crosses TP ranks or pipeline stages (the local 1/cp of its tokens), and one layer's K/V."""
    t = settings.train
    tokens_dim = t.batch_size * t.seq_len // dims.cp * settings.model.dim * compute_bytes
    tp = tokens_dim if dims.tp > 1 else 0
    pp = 2 * tokens_dim * n_stages_here if dims.pp > 1 else 0
    cp = kv_gather_bytes(settings, dims, compute_bytes) if dims.cp > 1 else 0
    return tp, pp, cp


def kv_gather_bytes(settings: JobSettings, dims: ParallelDims, compute_bytes: int) -> int:
    """K and V of one layer over a whole micro-batch sequence (local KV heads): what CP gathers per layer.

    Ring attention (``cp_attention = ring``) passes K/V repeated to the query heads (torch's ring
    kernels run without SDPA's GQA), and its default rotation all-gathers them too.
    """
    t = settings.train
    ring = settings.distributed.cp_attention == "ring"
    return kv_bytes(settings.model, t.batch_size * t.seq_len, ring=ring, tp=dims.tp, compute_bytes=compute_bytes)


def kv_bytes(model: ModelSettings, tokens: int, *, ring: bool, tp: int, compute_bytes: int) -> int:
    """K and V of one layer over ``tokens`` on one TP rank (:func:`kv_gather_bytes`)."""
    heads = model.n_heads if ring else model.kv_heads
    return 2 * tokens * heads * model.head_dim // tp * compute_bytes


@dataclass(frozen=True)
class Throughput:
    """Work of one optimizer step and the time a stated MFU implies."""

    tokens_per_step: int
    flops_per_token: float
    flops_per_step: float
    mfu: float
    peak_tflops: float | None  # per GPU, in the compute dtype (None = unknown device)
    step_time_s: float | None
    tokens_per_s: float | None


def throughput(settings: JobSettings, dims: ParallelDims, compute_dtype: str, mfu: float) -> Throughput:
    """FLOPs per step (the model family's count) and the step time at ``mfu`` of the GPU's peak.

    With float8, the blocks' linear layers run at the float8 peak and the rest (head,
    attention scores) at the compute dtype's.
    """
    t, m = settings.train, settings.model
    family = family_for(m)
    tokens = t.tokens_per_step(dims.dp)
    fpt = family.flops_per_token(m, t.seq_len)
    flops = fpt * tokens
    override = settings.metrics.peak_tflops
    peak = override * _T if override is not None else peak_flops(settings.slurm.gpu_type, compute_dtype)
    if peak is None or mfu <= 0:
        return Throughput(tokens, fpt, flops, mfu, None, None, None)
    seconds = flops / (dims.world_size * peak)
    fp8_peak = peak_flops(settings.slurm.gpu_type, "fp8") if t.float8 and override is None else None
    if fp8_peak is not None:
        fp8_flops = 6.0 * m.n_layers * family.block_linear_params(m) * tokens
        seconds = (flops - fp8_flops) / (dims.world_size * peak) + fp8_flops / (dims.world_size * fp8_peak)
    step = seconds / mfu
    return Throughput(tokens, fpt, flops, mfu, peak / _T, step, tokens / step)
