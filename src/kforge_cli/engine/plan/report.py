"""The text table and JSON of a `ParallelPlan` (what `kforge plan` prints, and `validate-config --plan`)."""

from __future__ import annotations

import json

from kforge_cli.engine.plan.cost_model import step_parts
from kforge_cli.engine.plan.planner import ParallelPlan
from kforge_cli.engine.plan.sharded_model import StageLayout

GIB = 1024**3
MAX_STAGE_LINES = 16


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if i is not None:
            start = prev = i
    return ",".join(parts)


def _stage_line(s: StageLayout) -> str:
    extra = (["embedding"] if s.embedding else []) + (["norm + head"] if s.head else [])
    tail = f" + {', '.join(extra)}" if extra else ""
    n = len(s.layers)
    return f"    stage {s.stage} on pp rank {s.pp_rank}: {n} block{'s' if n != 1 else ''} ({_ranges(s.layers)}){tail}"


def _count(n: int) -> str:
    """``70553706496`` -> ``70.55B``; ``1735936`` -> ``1.74M``."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_plan(plan: ParallelPlan) -> str:
    """A plain-text report: mesh, stages, the memory table with its verdict, step time, warnings."""
    mesh = plan.mesh
    unit, scale = ("GiB", GIB) if plan.peak_bytes >= GIB else ("MiB", 1024**2)
    coords = " ".join(f"{k}={v}" for k, v in plan.coordinates.items())
    lines = [
        f"parallel plan: profile {plan.profile or '-'}, world size {plan.world_size}, rank {plan.rank} "
        f"(built in {plan.build_seconds:.1f} s)",
        f"  mesh: pp={mesh['pp']} x dp_replicate={mesh['dp_replicate']} x dp_shard={mesh['dp_shard']} "
        + (f"(= {mesh['dp_shard'] // mesh['ep']} x ep={mesh['ep']}) " if "ep" in mesh else "")
        + (f"x cp={mesh['cp']} " if "cp" in mesh else "")
        + f"x tp={mesh['tp']}; rank {plan.rank} sits at {coords}",
        "  pipeline stages:" if mesh["pp"] > 1 else "  layers (no pipeline):",
    ]
    shown = plan.stages[:MAX_STAGE_LINES]
    lines += [_stage_line(s) for s in shown]
    if len(plan.stages) > len(shown):
        lines.append(f"    ... {len(plan.stages) - len(shown)} more stages")
    lines.append(
        f"  model: {_count(plan.total_params)} parameters; rank {plan.rank} holds {_count(plan.local_params)} "
        f"in stage(s) {_ranges(plan.rank_stages)} ({plan.param_dtype} master, {plan.compute_dtype} compute)"
    )
    lines += ["", f"  {'memory of rank ' + str(plan.rank):<30}{unit:>9}  {'when':<10} detail"]
    for m in plan.memory:
        lines.append(f"  {m.name:<30}{m.bytes / scale:9.2f}  {m.phase:<10} {m.detail}")
    share = plan.peak_bytes / plan.capacity_bytes if plan.capacity_bytes else 0.0
    lines.append(
        f"  {'peak':<30}{plan.peak_bytes / scale:9.2f}  of {plan.capacity_bytes / scale:.2f} {unit} ({share:.0%})"
    )
    big = plan.biggest
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(f"  {verdict} (biggest item: {big.name}, {big.bytes / scale:.2f} {unit})")
    t = plan.throughput
    lines += [
        "",
        f"  step: {t.tokens_per_step:,} tokens, {t.flops_per_step:.3g} FLOPs ({t.flops_per_token / 1e9:.1f} GFLOP/token)",
    ]
    e, c = plan.step, plan.constants
    if e is not None and c is not None:
        lines.append(
            f"  at {c.mfu:.0%} MFU of {c.peak_flops / 1e12:.1f} TFLOP/s per GPU: {e.step_s:.4g} s/step, "
            f"{e.tokens_per_s:,.0f} tokens/s (the cost model of `kforge plan search`)"
        )
        lines.append("    " + step_parts(e))
        lines.append(f"    constants: {c.describe()}")
    elif t.step_time_s is not None and t.tokens_per_s is not None:
        lines.append(
            f"  at {t.mfu:.0%} MFU of {t.peak_tflops:.1f} TFLOP/s per GPU: {t.step_time_s:.4g} s/step, "
            f"{t.tokens_per_s:,.0f} tokens/s ({plan.step_note})"
        )
    else:
        lines.append(f"  step time: unknown ({plan.step_note or 'set metrics.peak_tflops'})")
    if plan.warnings:
        lines += ["", "  warnings:"] + [f"    - {w}" for w in plan.warnings]
    if plan.notes:
        lines += ["", "  notes:"] + [f"    - {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_json(plan: ParallelPlan) -> str:
    """The plan as indented JSON."""
    return json.dumps(plan.to_dict(), indent=2)
