"""`kforge plan search`: the fastest layouts of a model on a world size, by the plan's own rules.

Enumerated, for the profile's model, sequence length and global batch (in sequences, kept
by every layout): ``tp`` (within a node when the job spans nodes), ``cp``, ``pp`` with each
schedule and stages per rank (2..8 for the interleaved ones), ``dp_replicate x dp_shard``
(the rest), ``ep`` (MoE), the micro-batch size with the accumulation that keeps the global
batch, and the activation checkpointing mode (none, selective op, selective block, full).

Every layout's step time is predicted first (``plan.cost_model``: cheap, cached per rank
placement; the slowest of all pipeline ranks). Then, fastest first, each is checked by the same
rules as ``validate-config`` (settings.rules), so an invalid one never appears, and by the same
memory plan as ``kforge plan`` (planner's ``param_items`` + ``activation_items``) on *every* pipeline rank (the
worst counts; the first and last rank first, and a layout whose parameters, gradients and
optimizer state alone exceed the GPU is out without building anything), with the
parameter shards of ``plan.param_shards`` (equal to the meta build's, without a model per
layout). The first layout that passes of each mesh and schedule (tp, cp, pp schedule,
dp_replicate, dp_shard, ep) is its best stage split, micro-batch and AC mode; the search
stops when ``top`` meshes are found. The memory items are cached by what they depend on,
so a 70B model on 1024 GPUs is searched in seconds (bench/plan_search.py). The settings' own
layout, when it is in the search space, valid and within the limit, is listed too (``given``),
with the number ``kforge plan`` prints for it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from kforge_cli.engine.parallel.build import compute_dtype
from kforge_cli.engine.parallel.fsdp import resolve_reshard_after_forward
from kforge_cli.engine.plan.activations import pipeline_in_flight
from kforge_cli.engine.plan.cost_model import (
    KINDS,
    CostConstants,
    RankWork,
    StepEstimate,
    StepShape,
    cost_constants,
    estimate_step,
    rank_work,
    step_parts,
)
from kforge_cli.engine.plan.layouts import (
    Layout,
    cluster_shape,
    global_batch_of,
    layout_of,
    layouts,
    with_layout,
)
from kforge_cli.engine.plan.memory_items import (
    GIB,
    TIGHT_FRACTION,
    MemoryItem,
    activation_items,
    param_items,
    peak_of,
)
from kforge_cli.engine.plan.param_shards import RankPlace, ShardTemplate, build_template, rank_place
from kforge_cli.engine.plan.sharded_model import MetaBuild, target_device
from kforge_cli.engine.runtime.dtypes import dtype_name
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings, ParallelDims, config_issues, resolve_dims, world_size_issues
from kforge_cli.settings.infrastructure import MAX_WORLD_SIZE

MAX_SEARCH_S = 300.0  # the search's wall-time bound (a search at real sizes takes seconds)
CacheKey = tuple[Hashable, ...]  # a memo key: compared and hashed, never read back


@dataclass
class Candidate:
    """A valid layout that fits, with its predicted step and its worst rank's memory."""

    layout: Layout
    settings: JobSettings
    dims: ParallelDims
    estimate: StepEstimate
    peak_bytes: int
    peak_pp_rank: int
    capacity_bytes: int
    reason: str = ""

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    def as_dict(self) -> dict[str, object]:
        return {
            "layout": {**self.layout.distributed(), **self.layout.train()},
            "overrides": self.layout.overrides(),
            "predicted": self.estimate.as_dict(),
            "peak_bytes": self.peak_bytes,
            "peak_pp_rank": self.peak_pp_rank,
            "capacity_bytes": self.capacity_bytes,
            "reason": self.reason,
        }


@dataclass
class SearchResult:
    """What the search found and how much it looked at."""

    profile: str | None
    world_size: int
    gpu_type: str
    gpus_per_node: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    constants: CostConstants
    memory_limit_bytes: int = 0
    enumerated: int = 0
    invalid: int = 0
    checked: int = 0  # layouts checked against the rules and the memory plan (the fastest first)
    too_big: int = 0
    fitting: int = 0
    seconds: float = 0.0
    top: list[Candidate] = field(default_factory=list)
    best_memory: list[MemoryItem] = field(default_factory=list)
    fastest_rejected: tuple[Layout, StepEstimate, int, bool] | None = None  # fastest over the limit (peak, by bound)
    given: Candidate | None = None  # the settings' own layout, when in the search space, valid and within the limit
    given_note: str = ""  # why it is not listed (outside the search space, invalid, over the limit)

    def as_dict(self) -> dict[str, object]:
        rejected = None
        if self.fastest_rejected is not None:
            layout, est, peak, bound = self.fastest_rejected
            rejected = {
                "layout": {**layout.distributed(), **layout.train()},
                "step_s": est.step_s,
                "peak_bytes": peak,
                "held_bytes_alone_over": bound,
            }
        return {
            "profile": self.profile,
            "world_size": self.world_size,
            "gpu_type": self.gpu_type,
            "gpus_per_node": self.gpus_per_node,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "constants": self.constants.as_dict(),
            "memory_limit_bytes": self.memory_limit_bytes,
            "enumerated": self.enumerated,
            "invalid": self.invalid,
            "checked": self.checked,
            "rejected_by_memory": self.too_big,
            "fitting": self.fitting,
            "seconds": self.seconds,
            "top": [cand.as_dict() for cand in self.top],
            "fastest_rejected_by_memory": rejected,
            "given": self.given.as_dict() if self.given is not None else None,
            "given_note": self.given_note,
        }


class _Memo:
    """The memory plan's and the cost model's pieces for many layouts, each computed once per what it depends on."""

    def __init__(self, settings: JobSettings, template: ShardTemplate, cbytes: int, cuda: bool) -> None:
        self.template, self.cbytes, self.cuda = template, cbytes, cuda
        self.state_slots = 1 if settings.optimizer.name in ("lion", "muon") else 2
        self.builds: dict[CacheKey, MetaBuild] = {}
        self.params: dict[CacheKey, list[MemoryItem]] = {}
        self.acts: dict[CacheKey, list[MemoryItem]] = {}
        self.places: dict[CacheKey, RankPlace] = {}
        self.work: dict[CacheKey, RankWork] = {}
        self.bounds: dict[CacheKey, float] = {}
        self.candidates: dict[CacheKey, list[tuple[RankWork, int]]] = {}
        self.reshard_setting = settings.distributed.reshard_after_forward

    @staticmethod
    def _pipeline_key(s: JobSettings, dims: ParallelDims, pp_rank: int) -> CacheKey:
        d = s.distributed
        return (dims.pp, d.pp_stages_per_rank, d.pp_schedule, pp_rank) if dims.pp > 1 else (1, pp_rank)

    def _shard_key(self, dims: ParallelDims) -> CacheKey:
        return (dims.tp, dims.ep, dims.dp_shard, dims.cp, dims.world_size > 1)

    def held_bound(self, dims: ParallelDims) -> float:
        key = (*self._shard_key(dims), dims.pp)
        bound = self.bounds.get(key)
        if bound is None:
            bound = self.bounds[key] = self.template.held_lower_bound(dims, self.state_slots)
        return bound

    def place(self, s: JobSettings, dims: ParallelDims, pp_rank: int) -> RankPlace:
        key = self._pipeline_key(s, dims, pp_rank)
        found = self.places.get(key)
        if found is None:
            found = self.places[key] = rank_place(s, pp_rank)
        return found

    def estimate(self, s: JobSettings, layout: Layout, dims: ParallelDims, consts: CostConstants) -> StepEstimate:
        """The step of the slowest pipeline rank (every rank is considered: :meth:`slowest_candidates`).

        ``s`` is the base settings: what the layout changes is read from ``layout``.
        """
        shape = StepShape(
            layout.batch_size,
            layout.grad_accum_steps,
            layout.pp_schedule,
            layout.pp_stages_per_rank,
            self.reshard(layout.pp),
            layout.activation_checkpointing == "full",
        )
        ranks = self.slowest_candidates(s, layout, dims)
        best: StepEstimate | None = None
        for work, r in ranks:
            e = estimate_step(s, shape, dims, work, consts, self.cbytes, pp_rank=r)
            if best is None or e.step_s > best.step_s:
                best = e
        assert best is not None
        return best

    def slowest_candidates(self, s: JobSettings, layout: Layout, dims: ParallelDims) -> list[tuple[RankWork, int]]:
        """The pipeline ranks that may be the slowest (cached): each distinct work once, with its first rank,
        less those another rank dominates (does at least as much of everything: never the slower)."""
        ckey = (layout.pp, layout.pp_stages_per_rank, layout.pp_schedule, dims.tp, dims.ep)
        ckey += (layout.activation_checkpointing, layout.ac_selective_mode)
        found = self.candidates.get(ckey)
        if found is not None:
            return found
        works: dict[RankWork, int] = {}
        for r in range(dims.pp):
            pkey = (layout.pp, layout.pp_stages_per_rank, layout.pp_schedule, r)
            place = self.places.get(pkey)
            if place is None:
                place = self.places[pkey] = rank_place(self.ac_settings(s, layout), r)
            key = (place, dims.tp, dims.ep, layout.activation_checkpointing, layout.ac_selective_mode)
            work = self.work.get(key)
            if work is None:
                work = self.work[key] = rank_work(
                    self.ac_settings(s, layout), dims, self.template, place, cuda=self.cuda
                )
            works.setdefault(work, r)
        found = self.candidates[ckey] = [
            (w, r) for w, r in works.items() if not any(o is not w and w.dominated_by(o) for o in works)
        ]
        return found

    def reshard(self, pp: int) -> bool:
        """``resolve_reshard_after_forward`` of the base settings at this ``pp``."""
        given = self.reshard_setting
        return given if given is not None else pp == 1

    def ac_settings(self, s: JobSettings, layout: Layout) -> JobSettings:
        """``s`` with the layout's pipeline and AC mode (what rank placement and rank work read)."""
        dist = s.distributed.model_copy(
            update={"pp": layout.pp, "pp_schedule": layout.pp_schedule, "pp_stages_per_rank": layout.pp_stages_per_rank}
        )
        train = s.train.model_copy(
            update={
                "activation_checkpointing": layout.activation_checkpointing,
                "ac_selective_mode": layout.ac_selective_mode,
            }
        )
        return s.model_copy(update={"distributed": dist, "train": train})

    def build(self, s: JobSettings, dims: ParallelDims, pp_rank: int) -> MetaBuild:
        key = (*self._shard_key(dims), *self._pipeline_key(s, dims, pp_rank))
        built = self.builds.get(key)
        if built is None:
            built = self.builds[key] = self.template.build(s, dims, pp_rank)
        return built

    def peak(self, s: JobSettings, dims: ParallelDims, pp_rank: int) -> tuple[int, list[MemoryItem]]:
        """The memory plan's peak of pipeline rank ``pp_rank`` (and its items)."""
        built = self.build(s, dims, pp_rank)
        d, t = s.distributed, s.train
        pkey = (id(built), dims.dp_shard > 1, resolve_reshard_after_forward(s))
        held = self.params.get(pkey)
        if held is None:
            held = self.params[pkey] = param_items(s, dims, built, self.cbytes)
        in_flight = pipeline_in_flight(d.pp_schedule, dims.pp, pp_rank, d.pp_stages_per_rank, t.grad_accum_steps)
        akey = (dims.tp, dims.cp, dims.pp > 1, dims.world_size > 1, t.batch_size, t.activation_checkpointing)
        akey += (t.ac_selective_mode, tuple(built.block_ids), built.has_head, in_flight, len(built.rank_stages))
        transient = self.acts.get(akey)
        if transient is None:
            transient = self.acts[akey] = activation_items(s, dims, built, self.cbytes)[0]
        items = held + transient
        return peak_of(items), items

    def worst_peak(self, s: JobSettings, dims: ParallelDims, capacity: int) -> tuple[int, int]:
        """(the highest peak of any pipeline rank, that rank); ranks at other coordinates 0 hold the largest chunks.

        The first and last pipeline ranks come first (the most in flight, the head): once one of
        them is over ``capacity`` the layout is out and the others are not looked at.
        """
        peak, worst = 0, 0
        order = [0, *([dims.pp - 1] if dims.pp > 1 else []), *range(1, dims.pp - 1)]
        for r in order:
            bytes_r, _ = self.peak(s, dims, r)
            if bytes_r > peak:
                peak, worst = bytes_r, r
            if peak > capacity:
                break
        return peak, worst


def predict_step(
    settings: JobSettings, world_size: int, *, mfu: float | None = None, template: ShardTemplate | None = None
) -> StepEstimate:
    """The cost model's step of ``settings``' own layout at ``world_size`` (constants from its ``[plan]``)."""
    dims = resolve_dims(settings, world_size)
    device = target_device(settings)
    cdtype = compute_dtype(settings, device)
    consts = cost_constants(settings, dtype_name(cdtype), mfu)
    memo = _Memo(settings, template or build_template(settings), cdtype.itemsize, device.type == "cuda")
    return memo.estimate(settings, layout_of(settings, dims), dims, consts)


def predict_layout(
    settings: JobSettings, world_size: int, *, mfu: float | None = None, template: ShardTemplate | None = None
) -> tuple[StepEstimate, int]:
    """:func:`predict_step` and the memory plan's worst peak over the pipeline ranks."""
    template = template or build_template(settings)
    peak, _ = memory_peak(settings, world_size, template=template)
    return predict_step(settings, world_size, mfu=mfu, template=template), peak


def memory_peak(settings: JobSettings, world_size: int, *, template: ShardTemplate | None = None) -> tuple[int, int]:
    """The memory plan's worst peak over the pipeline ranks of ``settings``' own layout at ``world_size``
    (and that pipeline rank), as the search checks each layout; no cost model, so any device."""
    dims = resolve_dims(settings, world_size)
    device = target_device(settings)
    memo = _Memo(
        settings, template or build_template(settings), compute_dtype(settings, device).itemsize, device.type == "cuda"
    )
    return memo.worst_peak(settings, dims, 2**62)


def search_layouts(
    settings: JobSettings,
    world_size: int,
    *,
    top: int = 5,
    global_batch: int | None = None,
    mfu: float | None = None,
    memory_share: float = TIGHT_FRACTION,
    time_limit_s: float = MAX_SEARCH_S,
) -> SearchResult:
    """The ``top`` fastest valid layouts whose peak is within ``memory_share`` of the GPU (module docstring).

    Refused (exit 2) above :data:`MAX_WORLD_SIZE`, and when it runs past ``time_limit_s``.
    """
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidInputError(
            f"--world-size must be from 1 to {MAX_WORLD_SIZE:,}, kforge's maximum (got {world_size})"
        )
    if settings.vlm is not None:
        raise InvalidInputError("kforge plan search covers text models; a VLM's vision tower is outside its cost model")
    if top < 1:
        raise InvalidInputError(f"--top must be at least 1 (got {top})")
    if not 0 < memory_share <= 1:
        raise InvalidInputError(f"--memory-share must be in (0, 1] (got {memory_share})")
    start = time.perf_counter()
    nodes, gpn = cluster_shape(settings, world_size)
    batch = global_batch if global_batch is not None else global_batch_of(settings, world_size)
    if batch < 1:
        raise InvalidInputError(f"--global-batch must be at least 1 (got {batch})")
    slurm = settings.slurm.model_copy(update={"nodes": nodes, "gpus_per_node": gpn})
    base = settings.model_copy(update={"slurm": slurm})
    device = target_device(settings)
    cdtype = compute_dtype(settings, device)
    consts = cost_constants(base, dtype_name(cdtype), mfu)
    template = build_template(settings)
    memo = _Memo(settings, template, cdtype.itemsize, device.type == "cuda")
    capacity = int(settings.slurm.gpu_memory_gb * GIB)
    limit = int(capacity * memory_share)
    result = SearchResult(
        settings.profile, world_size, settings.slurm.gpu_type, gpn, batch, settings.train.seq_len, consts, limit
    )
    predicted: list[tuple[float, int, Layout, ParallelDims, StepEstimate]] = []

    def over_time() -> None:
        if time.perf_counter() - start > time_limit_s:
            raise InvalidInputError(
                f"the layout search for world size {world_size} did not finish within {time_limit_s:g} s: narrow it "
                "by fixing some of distributed.tp, pp, cp or ep, or search a smaller world size"
            )

    given = _own_layout(settings, world_size)
    in_space = False
    for groups in layouts(settings, world_size, batch):
        over_time()
        for group in groups:
            for order, layout in enumerate(group):
                dims = ParallelDims(layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp, layout.ep)
                estimate = memo.estimate(base, layout, dims, consts)
                predicted.append((estimate.step_s, order, layout, dims, estimate))
                in_space = in_space or layout == given
    result.enumerated = len(predicted)
    predicted.sort(key=lambda p: (p[0], p[1]))
    found: list[Candidate] = []
    done: set[CacheKey] = set()
    for _, _, layout, dims, estimate in predicted:
        family = layout.family()
        if family in done:
            continue  # a faster variant of this mesh and schedule is already in
        over_time()
        result.checked += 1
        s = with_layout(base, layout, nodes, gpn)
        if config_issues(s) or world_size_issues(s, world_size):
            result.invalid += 1
            continue
        bound = memo.held_bound(dims)
        if bound > limit:
            peak, worst = int(bound), -1  # parameters, gradients and optimizer state alone do not fit
        else:
            peak, worst = memo.worst_peak(s, dims, limit)
        if peak > limit:
            result.too_big += 1
            if result.fastest_rejected is None and not found:
                result.fastest_rejected = (layout, estimate, peak, worst < 0)
            continue
        found.append(Candidate(layout, s, dims, estimate, peak, worst, capacity))
        done.add(family)
        if len(found) == top:
            break
    result.fitting = len(found)
    result.top = found
    if given is None:
        result.given_note = "its layout does not resolve at this world size"
    elif not in_space:
        result.given_note = "its layout is outside the search space (another global batch, or a mesh not searched)"
    else:
        _check_given(result, memo, base, given, consts, nodes, gpn, limit, capacity)
    explain(result)
    if result.top:
        best = result.top[0]
        result.best_memory = memo.peak(best.settings, best.dims, best.peak_pp_rank)[1]
    result.seconds = time.perf_counter() - start
    return result


def _own_layout(settings: JobSettings, world_size: int) -> Layout | None:
    try:
        return layout_of(settings, resolve_dims(settings, world_size))
    except InvalidInputError:
        return None


def _check_given(
    result: SearchResult,
    memo: _Memo,
    base: JobSettings,
    layout: Layout,
    consts: CostConstants,
    nodes: int,
    gpn: int,
    limit: int,
    capacity: int,
) -> None:
    """The settings' own layout, predicted and checked as the search checks every layout."""
    dims = ParallelDims(layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp, layout.ep)
    s = with_layout(base, layout, nodes, gpn)
    if config_issues(s) or world_size_issues(s, result.world_size):
        result.given_note = "its layout breaks a rule at this world size"
        return
    peak, worst = memo.worst_peak(s, dims, 2**62)
    if peak > limit:
        result.given_note = f"its layout's peak, {peak / GIB:.1f} GiB, is over the limit"
        return
    estimate = memo.estimate(base, layout, dims, consts)
    result.given = Candidate(layout, s, dims, estimate, peak, worst, capacity, "the settings' own layout")


COMPONENTS = {
    "recompute": "activation recompute",
    "fsdp": "exposed FSDP communication",
    "tp": "exposed TP communication",
    "cp": "exposed CP K/V communication",
    "ep": "exposed EP all-to-all",
    "pp": "exposed pipeline send/receive",
    "bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "compute": "slower matmuls (small micro-batch) or more FLOPs per rank",
}


def _components(e: StepEstimate) -> dict[str, float]:
    out = {"compute": e.compute_s - e.recompute_s, "recompute": e.recompute_s, "bubble": e.bubble_s}
    out["optimizer"] = e.optimizer_s
    for kind in KINDS:
        out[kind] = e.exposed.get(kind, 0.0)
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def explain(result: SearchResult) -> None:
    """Give each of the top layouts the reason it wins or loses against the first."""
    if not result.top:
        return
    best = result.top[0]
    b = _components(best.estimate)
    for i, cand in enumerate(result.top):
        if i == 0:
            exposed = best.estimate.exposed_s
            worst = max(best.estimate.exposed, key=lambda k: best.estimate.exposed[k], default=None)
            parts = [
                f"exposed communication {exposed:.2f} s" + (f" (mostly {worst})" if worst and exposed > 0 else ""),
                f"bubble {best.estimate.bubble:.0%}" if best.estimate.bubble else "no bubble",
                f"recompute {best.estimate.recompute_s:.2f} s" if best.estimate.recompute_s else "no recompute",
                f"{_gib(best.headroom_bytes)} memory headroom",
            ]
            cand.reason = "fastest: " + ", ".join(parts)
            continue
        c = _components(cand.estimate)
        delta = {k: c[k] - b[k] for k in c}
        key = max(delta, key=lambda k: delta[k])
        slower = cand.estimate.step_s / best.estimate.step_s - 1
        what = COMPONENTS.get(key, f"exposed {key} communication")
        if key == "compute":
            if cand.estimate.efficiency < best.estimate.efficiency:
                what = f"smaller matmuls (micro-batch runs at {cand.estimate.efficiency:.0%} speed)"
            else:
                what = "more FLOPs on its busiest rank (uneven pipeline stages, or MoE experts whole on each TP rank)"
        text = f"+{slower:.1%}: {what} +{delta[key]:.2f} s"
        gained = cand.headroom_bytes - best.headroom_bytes
        if gained > GIB // 10:
            text += f"; {_gib(gained)} more memory headroom"
        cand.reason = text


def format_search(result: SearchResult, top: int | None = None) -> str:
    """The text report of a search (its first ``top`` layouts)."""
    c = result.constants
    lines = [
        f"layout search: profile {result.profile or '-'}, world size {result.world_size} "
        f"({result.gpu_type}, {result.gpus_per_node} per node), global batch {result.global_batch} x "
        f"{result.seq_len} tokens",
        f"  cost model: {c.describe()}",
        f"  predicted {result.enumerated:,} layouts, then checked the fastest {result.checked:,} against the rules "
        f"and the memory plan in {result.seconds:.1f} s: {result.invalid:,} invalid, {result.too_big:,} over "
        f"{result.memory_limit_bytes / GIB:.1f} GiB per GPU; the best of each tp x cp x pp schedule x ep:",
    ]
    if not result.top:
        lines.append("  no valid layout fits: a bigger world size, a smaller micro-batch or model is needed")
        return "\n".join(lines)
    lines += ["", f"  {'#':>2} {'step':>9} {'tokens/s':>12} {'peak / GPU':>18}  layout"]
    for i, cand in enumerate(result.top[:top], 1):
        e = cand.estimate
        share = cand.peak_bytes / cand.capacity_bytes
        size = (
            f"{cand.peak_bytes / GIB:>8.1f} GiB" if cand.peak_bytes >= GIB else f"{cand.peak_bytes / 2**20:>8.1f} MiB"
        )
        lines.append(
            f"  {i:>2} {e.step_s:>7.4g} s {e.tokens_per_s:>12,.0f} {size} ({share:>4.0%})  {cand.layout.describe()}"
        )
        lines.append(f"{'':>7}{step_parts(e)}")
        lines.append(f"{'':>7}why: {cand.reason}")
    g = result.given
    if g is not None:
        rank = next((i for i, c in enumerate(result.top, 1) if c.layout == g.layout), None)
        where = f"#{rank} above" if rank else "not in the top: the best of its mesh and schedule is faster"
        share = g.peak_bytes / g.capacity_bytes
        lines += [
            "",
            f"  the profile's own layout ({where}):",
            f"  {'=':>2} {g.estimate.step_s:>7.4g} s {g.estimate.tokens_per_s:>12,.0f} {g.peak_bytes / GIB:>8.1f} GiB "
            f"({share:>4.0%})  {g.layout.describe()}",
            f"{'':>7}{step_parts(g.estimate)}",
        ]
    elif result.given_note:
        lines += ["", f"  the profile's own layout is not listed: {result.given_note}"]
    if result.fastest_rejected is not None:
        layout, est, peak, bound = result.fastest_rejected
        lines += [
            "",
            f"  faster, but over the memory limit: {layout.describe()} ({est.step_s:.4g} s, "
            f"peak {peak / GIB:.1f} GiB of {result.top[0].capacity_bytes / GIB:.0f}"
            + (": parameters, gradients and optimizer state alone, at least" if bound else "")
            + ")",
        ]
    return "\n".join(lines)
