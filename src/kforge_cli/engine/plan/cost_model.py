"""The step-time cost model of `validate-config --plan --search`: compute, exposed communication, bubble.

For one rank of a layout (the slowest pipeline rank), per optimizer step:

- **compute**: the rank's FLOPs (its blocks' and the head's matmuls on its tokens, TP-split
  where TP splits them; an MoE block's routed experts whole on every TP rank, top_k of them
  per token) plus the recompute of activation checkpointing (a checkpointed block runs its
  forward again: a third of its FLOPs; op-level AC recomputes the elementwise work,
  ``OP_AC_RECOMPUTE`` of the block), at ``peak x mfu``. Micro-batches of fewer than
  ``plan.full_speed_tokens`` tokens per rank run proportionally slower (small matmuls).
- **communication**, bytes per rank over the link its group spans (a group inside a node
  uses ``intra_node_gbps``, one across nodes ``inter_node_gbps``, each GPU at that rate):
  FSDP all-gathers of the TP-local parameters in the compute dtype (twice per micro-batch
  with ``reshard_after_forward``, else once), one fp32 reduce-scatter per step, an fp32
  all-reduce of the shards over ``dp_replicate``; TP: per block and micro-batch four
  activation-sized collectives forward and four backward (all-gather / reduce-scatter
  under sequence parallelism, all-reduce without), again in a recomputed forward; CP:
  the K/V all-gather per block forward (and recompute) and its reduce-scatter backward;
  EP: the all-to-all volume of ``plan.moe``; PP: one activation forward and one gradient
  backward per micro-batch and stage. A collective over ``k`` ranks moves ``(k-1)/k`` of
  its buffer through each rank (an all-reduce twice that).
- **overlap**: a share ``plan.<kind>_overlap`` of each kind's time runs under compute, the
  rest is exposed; together the hidden parts cannot exceed the compute time.
- **bubble**: the step is ``(compute + exposed) / (1 - bubble)``, with the idle share of
  the schedule: ``(pp-1) / (v m + pp-1)`` for GPipe, 1F1B and interleaved 1F1B (``v``
  stages per rank, ``m`` micro-batches); zero-bubble schedules split the backward and
  fill about two thirds of that (``(pp-1) / (3 v m + pp-1)``; Qi et al. 2023, ZB-H1).

The optimizer step and the data loader are not counted. Constants: :data:`HARDWARE` (per
GPU type, with sources) unless set in ``[plan]``; docs/distributed.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kforge_cli.engine.observe.mfu import match_device, peak_flops
from kforge_cli.engine.plan.costs import kv_bytes
from kforge_cli.engine.plan.moe import all_to_all_bytes
from kforge_cli.engine.plan.shards import HEAD_NAME, ParamSpec, RankPlace, ShardTemplate
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, ParallelDims
from kforge_cli.settings.pipeline_schedules import schedule_facts

GB = 1e9
FP32 = 4
OP_AC_RECOMPUTE = 0.05  # op-level AC: norms, activations and other elementwise work run again (assumed share)
LINK_EFFICIENCY = 0.8  # achieved collective bandwidth over the datasheet's per-direction figure (assumed)


@dataclass(frozen=True)
class Hardware:
    """Cost-model defaults of one GPU type (GB/s per GPU, achieved: datasheet per direction x 0.8)."""

    mfu: float
    intra_node_gbps: float
    inter_node_gbps: float
    source: str
    peak_tflops: float | None = None  # only where engine.observe.mfu has no peak (the CPU)
    full_speed_tokens: int = 4096  # the --plan warning for tiny per-GPU batches


def _link(per_direction_gbps: float) -> float:
    return round(per_direction_gbps * LINK_EFFICIENCY, 1)


_H100 = Hardware(
    0.40,
    _link(450),
    _link(50),
    "MFU: Llama 3 405B trained at 38-43% BF16 MFU on H100 (Dubey et al. 2024, table 4); NVLink 4: 900 GB/s "
    "bidirectional per GPU; one 400 Gb/s ConnectX-7 NIC per GPU (NVIDIA DGX H100 datasheet)",
)
_PCIE5 = Hardware(
    0.40, _link(64), _link(50), "PCIe Gen5 x16 (64 GB/s per direction) inside the node; 400 Gb/s NIC per GPU"
)
HARDWARE: dict[str, Hardware] = {
    "GH200": _H100,
    "H200 NVL": _PCIE5,
    "H200": _H100,
    "H100 NVL": _PCIE5,
    "H100 PCIE": _PCIE5,
    "H100": _H100,
    "A100": Hardware(
        0.50,
        _link(300),
        _link(25),
        "MFU: Megatron-LM, 52% of A100 peak at 175B (Narayanan et al. 2021); NVLink 3: 600 GB/s bidirectional; "
        "one 200 Gb/s HDR NIC per GPU (DGX A100 datasheet)",
    ),
    "B200": Hardware(
        0.40,
        _link(900),
        _link(50),
        "NVLink 5: 1.8 TB/s bidirectional; one 400 Gb/s NIC per GPU (DGX B200 datasheet); MFU: the H100 figure",
    ),
    "MI300X": Hardware(
        0.40,
        _link(448),
        _link(50),
        "Infinity Fabric: 7 links x 64 GB/s per direction (AMD MI300X datasheet); 400 Gb/s NIC; MFU: the H100 figure",
    ),
    "L40S": Hardware(0.40, _link(32), _link(25), "PCIe Gen4 x16 (32 GB/s); 200 Gb/s NIC assumed"),
    "L40": Hardware(0.40, _link(32), _link(25), "PCIe Gen4 x16 (32 GB/s); 200 Gb/s NIC assumed"),
    "L4": Hardware(0.40, _link(32), _link(25), "PCIe Gen4 x16 (32 GB/s); 200 Gb/s NIC assumed"),
    "V100": Hardware(0.40, _link(150), _link(12.5), "NVLink 2: 300 GB/s bidirectional; 100 Gb/s EDR NIC"),
    "CPU": Hardware(
        1.0,
        2.0,
        1.0,
        "placeholders for gloo on one machine (not a GPU): fit them with bench/plan_calibrate.py",
        peak_tflops=0.05,
    ),
}


@dataclass(frozen=True)
class CostConstants:
    """The resolved constants of the cost model, and where each came from."""

    peak_flops: float  # per GPU, compute dtype
    mfu: float
    intra_bps: float  # bytes/s per GPU
    inter_bps: float
    gpus_per_node: int
    overlap: dict[str, float]  # fsdp, tp, cp, ep, pp
    full_speed_tokens: int
    sources: dict[str, str] = field(default_factory=dict)


def cost_constants(settings: JobSettings, compute_dtype: str, mfu: float | None = None) -> CostConstants:
    """Constants for ``settings``: ``mfu`` (the CLI's --mfu), else ``[plan]``, else :data:`HARDWARE`."""
    p, gpu = settings.plan, settings.slurm.gpu_type
    key = match_device(gpu, HARDWARE)
    hw = HARDWARE[key] if key is not None else None
    sources: dict[str, str] = {}
    if settings.metrics.peak_tflops is not None:
        peak, sources["peak"] = settings.metrics.peak_tflops * 1e12, "metrics.peak_tflops"
    else:
        table = peak_flops(gpu, compute_dtype)
        if table is None and hw is not None and hw.peak_tflops is not None:
            table = hw.peak_tflops * 1e12
        if table is None:
            raise InvalidInputError(
                f"the layout search needs the peak FLOP/s of slurm.gpu_type={gpu!r} in {compute_dtype}, which kforge's "
                "table does not know: set --metrics.peak_tflops=N (dense TFLOP/s per device)"
            )
        peak, sources["peak"] = table, f"GPU table ({gpu})"

    def pick(name: str, given: float | None, default: float) -> float:
        if given is not None:
            sources[name] = f"plan.{name}"
            return given
        if hw is None:
            raise InvalidInputError(
                f"slurm.gpu_type={gpu!r} is not in the cost model's GPU table ({', '.join(HARDWARE)}): "
                f"set --plan.{name} (and plan.mfu, plan.intra_node_gbps, plan.inter_node_gbps)"
            )
        sources[name] = f"GPU table ({key})"
        return default

    chosen_mfu = mfu if mfu is not None else pick("mfu", p.mfu, hw.mfu if hw else 0.0)
    if mfu is not None:
        sources["mfu"] = "--mfu"
    intra = pick("intra_node_gbps", p.intra_node_gbps, hw.intra_node_gbps if hw else 0.0)
    inter = pick("inter_node_gbps", p.inter_node_gbps, hw.inter_node_gbps if hw else 0.0)
    return CostConstants(
        peak_flops=peak,
        mfu=chosen_mfu,
        intra_bps=intra * GB,
        inter_bps=inter * GB,
        gpus_per_node=settings.slurm.gpus_per_node,
        overlap={
            "fsdp": p.fsdp_overlap,
            "tp": p.tp_overlap,
            "cp": p.cp_overlap,
            "ep": p.ep_overlap,
            "pp": p.pp_overlap,
        },
        full_speed_tokens=int(pick("full_speed_tokens", p.full_speed_tokens, hw.full_speed_tokens if hw else 0)),
        sources=sources,
    )


@dataclass(frozen=True)
class BlockFlops:
    """FLOPs per token of one block kind on one TP rank (forward + backward), split by what TP splits."""

    split: float  # matmuls TP splits (attention projections, dense MLP, shared experts; the scores)
    whole: float  # matmuls every TP rank runs whole (router, routed experts)


def block_flops(template: ShardTemplate, settings: JobSettings, moe_kind: bool) -> BlockFlops:
    """6 x parameters (routed experts: top_k of them) + the attention scores, 12 x heads x head_dim x seq_len."""
    m = settings.model
    split = whole = 0.0
    for p in template.blocks[moe_kind]:
        if p.ep_dim is not None or ".experts." in f".{p.suffix}":
            assert m.moe is not None
            whole += 6.0 * p.numel * m.moe.top_k / m.moe.num_experts
        elif p.tp_dim is not None:
            split += 6.0 * p.numel
        else:
            whole += 6.0 * p.numel
    split += 12.0 * m.n_heads * m.head_dim * settings.train.seq_len
    return BlockFlops(split, whole)


@dataclass(frozen=True)
class StepEstimate:
    """The predicted step of one layout (seconds; ``comm`` raw per kind, ``exposed`` after overlap)."""

    compute_s: float  # including recompute
    recompute_s: float
    comm: dict[str, float]
    exposed: dict[str, float]
    bubble: float  # idle share of the step
    bubble_s: float
    step_s: float
    tokens_per_step: int
    efficiency: float  # the small-matmul factor applied to the MFU

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed.values())

    def as_dict(self) -> dict[str, object]:
        return {
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "compute_s": self.compute_s,
            "recompute_s": self.recompute_s,
            "comm_s": self.comm,
            "exposed_s": self.exposed,
            "bubble": self.bubble,
            "bubble_s": self.bubble_s,
            "efficiency": self.efficiency,
        }


def bubble_share(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The idle share of a pipeline step (module docstring)."""
    if pp == 1:
        return 0.0
    v, m = stages_per_rank, microbatches
    fill = 3 if schedule_facts(schedule).zero_bubble else 1
    return (pp - 1) / (fill * v * m + pp - 1)


def recompute_share(settings: JobSettings, layer: int, cuda: bool, attention_share: float) -> float:
    """Extra work of block ``layer`` under the AC mode, as a share of its forward + backward."""
    t = settings.train
    if t.activation_checkpointing == "full":
        return 1 / 3
    if t.activation_checkpointing == "selective":
        if t.ac_selective_mode == "op":  # matmuls (and SDPA on CUDA) are saved
            return OP_AC_RECOMPUTE + (0.0 if cuda else attention_share / 3)
        return 1 / 3 if layer % t.ac_every_n_blocks == 0 else 0.0
    return 0.0


def forward_rerun(settings: JobSettings, layer: int) -> bool:
    """Block ``layer`` runs its whole forward again in the backward (full AC, or block-level selective AC)."""
    t = settings.train
    if t.activation_checkpointing == "full":
        return True
    return (
        t.activation_checkpointing == "selective"
        and t.ac_selective_mode == "block"
        and (layer % t.ac_every_n_blocks == 0)
    )


def _group_link(c: CostConstants, world: int, stride: int, size: int) -> float:
    """Bandwidth of a group of ``size`` ranks ``stride`` apart: intra-node when they share a node."""
    if size <= 1:
        return c.intra_bps
    inside = world <= c.gpus_per_node or stride * size <= c.gpus_per_node
    return c.intra_bps if inside else c.inter_bps


@dataclass(frozen=True)
class RankWork:
    """What one rank computes and holds per token and step, for the cost model."""

    flops_per_token: float  # its blocks' and the head's matmuls, forward + backward, on its TP rank
    recompute_per_token: float  # what activation checkpointing runs again
    n_blocks: int
    rerun_blocks: int  # blocks whose whole forward runs again (their TP/CP collectives too)
    moe_blocks: int
    n_stages: int
    dense_numel: int  # TP-local parameters FSDP gathers over dp_shard x cp
    expert_numel: int  # routed experts' parameters FSDP gathers over dp_shard / ep (EP only)


def rank_work(
    settings: JobSettings, dims: ParallelDims, template: ShardTemplate, place: RankPlace, *, cuda: bool
) -> RankWork:
    """The :class:`RankWork` of the pipeline rank at ``place``."""
    m, t = settings.model, settings.train
    kinds = {k: block_flops(template, settings, k) for k in template.blocks}
    attention = 12.0 * m.n_heads * m.head_dim * t.seq_len / dims.tp
    flops = recompute = 0.0
    for i in place.block_ids:
        f = kinds[template.block_kind(i)]
        block = f.split / dims.tp + f.whole
        flops += block
        recompute += block * recompute_share(settings, i, cuda, attention / block)
    if place.has_head:  # the head (vocab-parallel under TP) and the final norm, 6 x parameters as --plan counts
        flops += 6.0 * m.vocab_size * m.dim / dims.tp
        flops += sum(6.0 * p.numel for p in template.tail if not p.suffix.endswith(HEAD_NAME))
    dense = expert = 0

    def add(specs: tuple[ParamSpec, ...], times: int = 1) -> None:
        nonlocal dense, expert
        for p in specs:
            split = (dims.tp if dims.tp > 1 and p.tp_dim is not None else 1) * (
                dims.ep if dims.ep > 1 and p.ep_dim is not None else 1
            )
            if dims.ep > 1 and p.ep_dim is not None:
                expert += times * (p.numel // split)
            else:
                dense += times * (p.numel // split)

    if place.has_embedding:
        add(template.head_first)
    counts = {k: sum(1 for i in place.block_ids if template.block_kind(i) == k) for k in template.blocks}
    for k, n in counts.items():
        add(template.blocks[k], n)
    if place.has_head:
        add(template.tail)
    return RankWork(
        flops_per_token=flops,
        recompute_per_token=recompute,
        n_blocks=len(place.block_ids),
        rerun_blocks=sum(forward_rerun(settings, i) for i in place.block_ids),
        moe_blocks=counts.get(True, 0),
        n_stages=len(place.stage_ids),
        dense_numel=dense,
        expert_numel=expert,
    )


@dataclass(frozen=True)
class StepShape:
    """What of a layout's step the cost model reads beyond the mesh and the rank's work."""

    batch_size: int
    grad_accum_steps: int
    pp_schedule: str
    pp_stages_per_rank: int
    reshard_after_forward: bool
    full_ac: bool

    @classmethod
    def of(cls, settings: JobSettings) -> StepShape:
        from kforge_cli.engine.parallel.fsdp import resolve_reshard_after_forward

        t, d = settings.train, settings.distributed
        return cls(
            t.batch_size,
            t.grad_accum_steps,
            d.pp_schedule,
            d.pp_stages_per_rank,
            resolve_reshard_after_forward(settings),
            t.activation_checkpointing == "full",
        )


def estimate_step(
    settings: JobSettings,
    shape: StepShape,
    dims: ParallelDims,
    work: RankWork,
    consts: CostConstants,
    compute_bytes: int,
) -> StepEstimate:
    """The predicted step time of a rank doing ``work`` (module docstring); ``settings`` gives the model,
    the sequence length and the CP attention, ``shape`` the rest."""
    m, seq = settings.model, settings.train.seq_len
    mb, steps = shape.batch_size, shape.grad_accum_steps
    cp, tp, ep, world = dims.cp, dims.tp, dims.ep, dims.world_size
    n_micro = mb * seq / cp  # tokens of one micro-batch on this rank
    eff = min(1.0, n_micro / consts.full_speed_tokens)
    rate = consts.peak_flops * consts.mfu * eff
    compute_s = n_micro * steps * work.flops_per_token / rate
    recompute_s = n_micro * steps * work.recompute_per_token / rate

    c = compute_bytes
    act = n_micro * m.dim * c  # one micro-batch's activation on this rank
    comm: dict[str, float] = {}
    if world > 1:  # FSDP: dense parameters over dp_shard x cp; routed experts (under EP) over dp_shard / ep
        gathers = steps * (2 if shape.reshard_after_forward else 1)
        inner = cp * tp
        fsdp = 0.0
        for numel, f, stride in (
            (work.dense_numel, dims.dp_shard * cp, tp),
            (work.expert_numel, dims.dp_shard // ep, ep * inner),
        ):
            if numel and f > 1:
                share = (f - 1) / f
                fsdp += (gathers * c + FP32) * numel * share / _group_link(consts, world, stride, f)
            if numel and dims.dp_replicate > 1:
                r = dims.dp_replicate
                link = _group_link(consts, world, dims.dp_shard * inner, r)
                fsdp += 2 * numel / max(f, 1) * FP32 * (r - 1) / r / link
        comm["fsdp"] = fsdp
    if tp > 1:
        passes = 8 * steps * work.n_blocks + 4 * steps * work.rerun_blocks
        comm["tp"] = passes * act * (tp - 1) / tp / _group_link(consts, world, 1, tp)
    if cp > 1:
        ring = settings.distributed.cp_attention == "ring"
        kv = kv_bytes(m, mb * seq, ring=ring, tp=tp, compute_bytes=c) * (cp - 1) / cp
        passes = 2 * steps * work.n_blocks + steps * work.rerun_blocks
        comm["cp"] = passes * kv / _group_link(consts, world, tp, cp)
    if ep > 1 and work.moe_blocks:
        a2a = all_to_all_bytes(m, ep, mb * seq * steps, shape.full_ac, work.moe_blocks, c)
        comm["ep"] = a2a / _group_link(consts, world, cp * tp, ep)
    if dims.pp > 1:
        stride = dims.dp_replicate * dims.dp_shard * cp * tp
        link = (
            consts.intra_bps
            if world <= consts.gpus_per_node or 2 * stride <= consts.gpus_per_node
            else consts.inter_bps
        )
        comm["pp"] = 2 * steps * work.n_stages * act / link

    total_compute = compute_s + recompute_s
    hidden = {k: v * consts.overlap[k] for k, v in comm.items()}
    exposed = {k: v - hidden[k] for k, v in comm.items()}
    spill = sum(hidden.values()) - total_compute
    if spill > 0:  # more to hide than there is compute: the excess is exposed, shared in proportion
        scale = spill / sum(hidden.values())
        exposed = {k: exposed[k] + hidden[k] * scale for k in comm}
    bubble = bubble_share(shape.pp_schedule, dims.pp, shape.pp_stages_per_rank, steps)
    busy = total_compute + sum(exposed.values())
    step = busy / (1 - bubble)
    return StepEstimate(
        compute_s=total_compute,
        recompute_s=recompute_s,
        comm=comm,
        exposed=exposed,
        bubble=bubble,
        bubble_s=step - busy,
        step_s=step,
        tokens_per_step=mb * seq * steps * dims.dp,
        efficiency=eff,
    )
