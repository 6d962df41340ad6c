"""The step-time cost model of `kforge plan`: one figure per layout, summed from its parts.

Every output (``kforge plan``, ``plan search``'s table, the written profile's description, the
trial comparison) prints this model's step, for the slowest pipeline rank (every pipeline rank
is timed), as

    step = (compute + exposed communication) / (1 - bubble share) + optimizer step

- **compute**: the rank's FLOPs (its blocks' and the head's matmuls on its tokens, TP-split
  where TP splits them; an MoE block's routed experts whole on every TP rank, top_k of them
  per token) plus the recompute of activation checkpointing (a checkpointed block runs its
  forward again: a third of its FLOPs; op-level AC recomputes the elementwise work,
  ``OP_AC_RECOMPUTE`` of the block), at ``peak x mfu``. Micro-batches of fewer than
  ``plan.full_speed_tokens`` tokens per rank run proportionally slower (small matmuls).
- **communication**: each parallelism's module exports its traffic (``comm_terms`` in
  ``engine.parallel.fsdp``, ``tensor_parallel``, ``context_parallel``, ``expert_parallel``,
  ``pipeline``: bytes per rank and step over a group of ranks); :func:`comm_traffic` collects
  them and each term runs over the link its group spans (a group inside a node at
  ``intra_node_gbps``, one across nodes at ``inter_node_gbps``, each GPU at that rate).
- **overlap**: a share ``plan.<kind>_overlap`` of each kind's time runs under compute, the
  rest is exposed; together the hidden parts cannot exceed the compute time.
- **bubble**: the idle share of the pipeline schedule (``engine.parallel.pipeline.bubble_share``).
- **optimizer step**: after the backward (and the pipeline's flush), every rank updates its
  parameter shards: the bytes the optimizer reads and writes per parameter
  (``costs.optimizer_step_bytes``: AdamW 7, Lion 5, Muon's momentum 5 parameter-sized
  passes) at ``plan.hbm_gbps``, plus Muon's Newton-Schulz FLOPs on its full matrices, split
  over the ranks of a stage (``optimizer.muon_distributed``), at ``peak x mfu``.

The data loader is not counted. Constants: :data:`HARDWARE` (per GPU type, with sources)
unless set in ``[plan]``; docs/distributed.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kforge_cli.engine.parallel import context_parallel, expert_parallel, fsdp, pipeline, tensor_parallel
from kforge_cli.engine.parallel.cost_terms import Traffic
from kforge_cli.engine.parallel.pipeline import bubble_share
from kforge_cli.engine.plan.costs import newton_schulz_flops, optimizer_step_bytes
from kforge_cli.engine.plan.param_shards import HEAD_NAME, ParamSpec, RankPlace, ShardTemplate
from kforge_cli.engine.runtime.device_peaks import match_device, peak_flops
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, ParallelDims

GB = 1e9
FP32 = 4
OP_AC_RECOMPUTE = 0.05  # op-level AC: norms, activations and other elementwise work run again (assumed share)
LINK_EFFICIENCY = 0.8  # achieved collective bandwidth over the datasheet's per-direction figure (assumed)
HBM_EFFICIENCY = 0.8  # achieved memory bandwidth of the optimizer's elementwise kernels over the datasheet's (assumed)
KINDS = ("fsdp", "tp", "cp", "ep", "pp")  # communication kinds, each with its plan.<kind>_overlap


@dataclass(frozen=True)
class Hardware:
    """Cost-model defaults of one GPU type (GB/s per GPU, achieved: datasheet per direction x 0.8)."""

    mfu: float
    intra_node_gbps: float
    inter_node_gbps: float
    source: str
    peak_tflops: float | None = None  # only where engine.observe.mfu has no peak (the CPU)
    full_speed_tokens: int = 4096  # the plan's warning for tiny per-GPU batches


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
        "placeholders for gloo on one machine (not a GPU): fit them with kforge plan calibrate",
        peak_tflops=0.05,
    ),
}
# HBM bandwidth per GPU, TB/s (datasheets); achieved: x HBM_EFFICIENCY. Keys matched like HARDWARE's.
HBM_TBPS: dict[str, float] = {
    "GH200": 4.0,  # 96 GB HBM3
    "H200 NVL": 4.8,
    "H200": 4.8,
    "H100 NVL": 3.9,
    "H100 PCIE": 2.0,
    "H100": 3.35,
    "A100": 2.0,  # 80 GB SXM: 2.04
    "B200": 8.0,
    "MI300X": 5.3,
    "L40S": 0.864,
    "L40": 0.864,
    "L4": 0.3,
    "V100": 0.9,
    "CPU": 0.025,  # a placeholder, like the CPU's other constants
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
    hbm_bps: float = 0.0  # bytes/s per GPU the optimizer step reads and writes at (0: not timed)
    sources: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "peak_tflops": self.peak_flops / 1e12,
            "mfu": self.mfu,
            "intra_node_gbps": self.intra_bps / GB,
            "inter_node_gbps": self.inter_bps / GB,
            "hbm_gbps": self.hbm_bps / GB,
            "overlap": self.overlap,
            "full_speed_tokens": self.full_speed_tokens,
            "sources": self.sources,
        }

    def describe(self) -> str:
        """One line: what the step time assumes, and where each constant came from."""
        return (
            f"{self.peak_flops / 1e12:.4g} TFLOP/s x MFU {self.mfu:.2f} ({self.sources.get('mfu', '')}); "
            f"{self.intra_bps / GB:g} GB/s per GPU in a node, {self.inter_bps / GB:g} GB/s between nodes "
            f"({self.sources.get('intra_node_gbps', '')}); HBM {self.hbm_bps / GB:g} GB/s; overlap "
            + " ".join(f"{k} {v:g}" for k, v in self.overlap.items())
        )


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
                f"the step-time model needs the peak FLOP/s of slurm.gpu_type={gpu!r} in {compute_dtype}, which kforge's "
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
    hbm_key = match_device(gpu, HBM_TBPS)
    hbm_default = HBM_TBPS[hbm_key] * 1000 * HBM_EFFICIENCY if hbm_key is not None else 0.0
    hbm = pick("hbm_gbps", p.hbm_gbps, hbm_default)
    return CostConstants(
        peak_flops=peak,
        mfu=chosen_mfu,
        intra_bps=intra * GB,
        inter_bps=inter * GB,
        gpus_per_node=settings.slurm.gpus_per_node,
        overlap={kind: getattr(p, f"{kind}_overlap") for kind in KINDS},
        full_speed_tokens=int(pick("full_speed_tokens", p.full_speed_tokens, hw.full_speed_tokens if hw else 0)),
        hbm_bps=hbm * GB,
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
    """The predicted step of one layout (seconds; ``comm`` raw per kind, ``exposed`` after overlap),
    for its slowest pipeline rank ``pp_rank``."""

    compute_s: float  # including recompute
    recompute_s: float
    comm: dict[str, float]
    exposed: dict[str, float]
    bubble: float  # idle share of the compute and exposed communication
    bubble_s: float
    step_s: float
    tokens_per_step: int
    efficiency: float  # the small-matmul factor applied to the MFU
    optimizer_s: float = 0.0
    pp_rank: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed.values())

    def parts(self) -> dict[str, float]:
        """The step's parts, which add up to ``step_s``: compute, exposed communication by kind, bubble, optimizer."""
        out = {"compute": self.compute_s}
        out.update({f"exposed {k}": v for k, v in self.exposed.items()})
        return {**out, "bubble": self.bubble_s, "optimizer": self.optimizer_s}

    def describe(self) -> str:
        """``1.382 s/step = compute 1.10 (...) + ...`` (:func:`step_parts`)."""
        return f"{self.step_s:.4g} s/step " + step_parts(self)

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
            "optimizer_s": self.optimizer_s,
            "pp_rank": self.pp_rank,
            "efficiency": self.efficiency,
        }


def step_parts(e: StepEstimate) -> str:
    """``= compute 1.100 s (recompute 0.200) + exposed comm fsdp 0.020, tp 0.100 + bubble 0.000 (0%) + optimizer
    0.010``: the parts every output prints beside the step time."""
    comm = ", ".join(f"{k} {v:.3f}" for k, v in e.exposed.items()) or "none"
    rank = f", pipeline rank {e.pp_rank} the slowest" if e.bubble else ""
    return (
        f"= compute {e.compute_s:.3f} s (recompute {e.recompute_s:.3f}) + exposed comm {comm} "
        f"+ bubble {e.bubble_s:.3f} ({e.bubble:.0%}{rank}) + optimizer {e.optimizer_s:.3f}"
    )


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
    dense_update_bytes: int = 0  # optimizer-step HBM traffic of the dense parameters (before FSDP sharding)
    expert_update_bytes: int = 0  # the same of the routed experts under EP
    muon_flops: float = 0.0  # Newton-Schulz FLOPs of the full matrices Muon manages on this pipeline rank

    def dominated_by(self, other: RankWork) -> bool:
        """Every quantity the step grows with is at most ``other``'s: this rank's step cannot be the longer
        (every part of the model is non-decreasing in each of them, and the bubble share is the same)."""
        return (
            self.flops_per_token <= other.flops_per_token
            and self.recompute_per_token <= other.recompute_per_token
            and self.n_blocks <= other.n_blocks
            and self.rerun_blocks <= other.rerun_blocks
            and self.moe_blocks <= other.moe_blocks
            and self.n_stages <= other.n_stages
            and self.dense_numel <= other.dense_numel
            and self.expert_numel <= other.expert_numel
            and self.dense_update_bytes <= other.dense_update_bytes
            and self.expert_update_bytes <= other.expert_update_bytes
            and self.muon_flops <= other.muon_flops
        )


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
    if (
        place.has_head
    ):  # the head (vocab-parallel under TP) and the final norm, 6 x parameters as the FLOPs count has it
        flops += 6.0 * m.vocab_size * m.dim / dims.tp
        flops += sum(6.0 * p.numel for p in template.tail if not p.suffix.endswith(HEAD_NAME))
    dense = expert = dense_update = expert_update = 0
    muon = 0.0
    opt = settings.optimizer

    def add(specs: tuple[ParamSpec, ...], times: int = 1) -> None:
        nonlocal dense, expert, dense_update, expert_update, muon
        for p in specs:
            split = (dims.tp if dims.tp > 1 and p.tp_dim is not None else 1) * (
                dims.ep if dims.ep > 1 and p.ep_dim is not None else 1
            )
            local = times * (p.numel // split)
            matrix = len(p.shape) == 2 and not p.embedding and not p.suffix.endswith(HEAD_NAME)
            update = local * optimizer_step_bytes(opt.name, p.element_size, matrix=matrix) if p.trainable else 0
            if dims.ep > 1 and p.ep_dim is not None:
                expert += local
                expert_update += update
            else:
                dense += local
                dense_update += update
            if opt.name == "muon" and matrix and p.trainable:
                muon += times * newton_schulz_flops(p.shape[0], p.shape[1], opt.muon_ns_steps)

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
        dense_update_bytes=dense_update,
        expert_update_bytes=expert_update,
        muon_flops=muon,
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


def comm_traffic(
    settings: JobSettings, shape: StepShape, dims: ParallelDims, work: RankWork, compute_bytes: int
) -> list[Traffic]:
    """The traffic of one rank per step: the sum of what each parallelism's module exports."""
    m, seq = settings.model, settings.train.seq_len
    mb, steps = shape.batch_size, shape.grad_accum_steps
    cp, tp, ep = dims.cp, dims.tp, dims.ep
    act = int(mb * seq / cp) * m.dim * compute_bytes  # one micro-batch's activation on this rank
    out: list[Traffic] = []
    if dims.world_size > 1:
        out += fsdp.comm_terms(
            dense_numel=work.dense_numel,
            expert_numel=work.expert_numel,
            dp_shard=dims.dp_shard,
            dp_replicate=dims.dp_replicate,
            cp=cp,
            tp=tp,
            ep=ep,
            micro_batches=steps,
            reshard_after_forward=shape.reshard_after_forward,
            compute_bytes=compute_bytes,
        )
    blocks = {"n_blocks": work.n_blocks, "rerun_blocks": work.rerun_blocks, "micro_batches": steps}
    out += tensor_parallel.comm_terms(tp=tp, activation_bytes=act, **blocks)
    if cp > 1:
        ring = settings.distributed.cp_attention == "ring"
        kv = context_parallel.kv_bytes(m, mb * seq, ring=ring, tp=tp, compute_bytes=compute_bytes)
        out += context_parallel.comm_terms(cp=cp, tp=tp, kv=kv, **blocks)
    if work.moe_blocks:
        out += expert_parallel.comm_terms(
            m,
            ep=ep,
            stride=cp * tp,
            tokens=mb * seq * steps,
            full_ac=shape.full_ac,
            n_moe_layers=work.moe_blocks,
            compute_bytes=compute_bytes,
        )
    stride = dims.dp_replicate * dims.dp_shard * cp * tp
    out += pipeline.comm_terms(
        pp=dims.pp, stride=stride, n_stages=work.n_stages, micro_batches=steps, activation_bytes=act
    )
    return out


def optimizer_seconds(settings: JobSettings, dims: ParallelDims, work: RankWork, consts: CostConstants) -> float:
    """The optimizer step of one rank: its shards' update traffic at HBM speed, and Muon's Newton-Schulz
    split over the ranks of its pipeline stage (or on every rank without ``muon_distributed``)."""
    shard = dims.dp_shard * dims.cp if dims.world_size > 1 else 1
    expert_shard = max(dims.dp_shard // dims.ep, 1) if dims.world_size > 1 else 1
    seconds = 0.0
    if consts.hbm_bps > 0:
        seconds += (work.dense_update_bytes / shard + work.expert_update_bytes / expert_shard) / consts.hbm_bps
    if work.muon_flops:
        split = dims.world_size // dims.pp if settings.optimizer.muon_distributed else 1
        seconds += work.muon_flops / max(split, 1) / (consts.peak_flops * consts.mfu)
    return seconds


def estimate_step(
    settings: JobSettings,
    shape: StepShape,
    dims: ParallelDims,
    work: RankWork,
    consts: CostConstants,
    compute_bytes: int,
    pp_rank: int = 0,
) -> StepEstimate:
    """The predicted step time of a rank doing ``work`` (module docstring); ``settings`` gives the model,
    the sequence length, the CP attention and the optimizer, ``shape`` the rest."""
    seq = settings.train.seq_len
    mb, steps = shape.batch_size, shape.grad_accum_steps
    n_micro = mb * seq / dims.cp  # tokens of one micro-batch on this rank
    eff = min(1.0, n_micro / consts.full_speed_tokens)
    rate = consts.peak_flops * consts.mfu * eff
    compute_s = n_micro * steps * work.flops_per_token / rate
    recompute_s = n_micro * steps * work.recompute_per_token / rate

    comm: dict[str, float] = {}
    world = dims.world_size
    for kind, size_bytes, size, stride in comm_traffic(settings, shape, dims, work, compute_bytes):
        comm[kind] = comm.get(kind, 0.0) + size_bytes / _group_link(consts, world, stride, size)
    total_compute = compute_s + recompute_s
    hidden = {k: v * consts.overlap[k] for k, v in comm.items()}
    exposed = {k: v - hidden[k] for k, v in comm.items()}
    spill = sum(hidden.values()) - total_compute
    if spill > 0:  # more to hide than there is compute: the excess is exposed, shared in proportion
        scale = spill / sum(hidden.values())
        exposed = {k: exposed[k] + hidden[k] * scale for k in comm}
    bubble = bubble_share(shape.pp_schedule, dims.pp, shape.pp_stages_per_rank, steps)
    busy = total_compute + sum(exposed.values())
    pipelined = busy / (1 - bubble)
    optimizer_s = optimizer_seconds(settings, dims, work, consts)
    return StepEstimate(
        compute_s=total_compute,
        recompute_s=recompute_s,
        comm=comm,
        exposed=exposed,
        bubble=bubble,
        bubble_s=pipelined - busy,
        step_s=pipelined + optimizer_s,
        tokens_per_step=mb * seq * steps * dims.dp,
        efficiency=eff,
        optimizer_s=optimizer_s,
        pp_rank=pp_rank,
    )
