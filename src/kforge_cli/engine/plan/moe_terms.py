"""What ``--plan`` says about Mixture-of-Experts: per-rank expert bytes and all-to-all volume.

Expert bytes are read from the meta build (the ``experts.w*`` shards this rank holds).
The all-to-all volume is that of expert parallelism: each MoE layer sends every routed
copy of a token (``tokens x top_k x dim`` in the compute dtype) to its expert's rank and
back, forward and again in the backward (and once more forward in the recompute of an
activation-checkpointed block), of which the ``(ep - 1) / ep`` share leaves the rank (a
balanced router's average). Without expert parallelism (``distributed.ep = 1``) there is
no all-to-all.

Under tensor parallelism only the shared experts are split (engine.parallel.tensor_parallel):
every TP rank routes all tokens of its data-parallel rank and runs the routed experts whole,
so it holds them unsplit and sends the same all-to-all volume as without TP.
"""

from __future__ import annotations

from kforge_cli.engine.parallel.expert_parallel import all_to_all_bytes
from kforge_cli.engine.plan.sharded_model import ParamShard
from kforge_cli.settings import JobSettings

GIB = 1024**3


def size_text(n_bytes: int) -> str:
    """``n`` GiB, or MiB below one GiB (a debug model's experts are a few MiB)."""
    return f"{n_bytes / GIB:.2f} GiB" if n_bytes >= GIB else f"{n_bytes / 2**20:.2f} MiB"


def expert_bytes(params: list[ParamShard]) -> int:
    """Bytes of routed-expert weights this rank holds."""
    return sum(p.local_bytes for p in params if ".experts." in p.name)


def all_to_all_bytes_per_step(settings: JobSettings, n_moe_layers_here: int, compute_bytes: int) -> int:
    """Bytes this rank sends by all-to-all per optimizer step (forward + backward, dispatch + combine)."""
    t = settings.train
    tokens = t.batch_size * t.seq_len * t.grad_accum_steps
    full_ac = t.activation_checkpointing == "full"
    return all_to_all_bytes(settings.model, settings.distributed.ep, tokens, full_ac, n_moe_layers_here, compute_bytes)


def moe_notes(settings: JobSettings, params: list[ParamShard], block_ids: list[int], compute_bytes: int) -> list[str]:
    """Plan notes for an MoE model (empty for a dense one)."""
    moe = settings.model.moe
    if moe is None:
        return []
    here = [i for i in block_ids if moe.is_moe_layer(i)]
    ep = settings.distributed.ep
    a2a = all_to_all_bytes_per_step(settings, len(here), compute_bytes)
    out = [
        f"MoE: {len(here)} MoE block(s) here, {moe.num_experts // max(1, ep)} of {moe.num_experts} experts each "
        f"(ep = {ep}); expert weights on this rank {size_text(expert_bytes(params))}",
        f"MoE all-to-all: {size_text(a2a)} sent per step by this rank" if a2a else "MoE all-to-all: none (ep = 1)",
    ]
    tp = settings.distributed.tp
    if tp > 1 and here:
        shared = "shared experts split over them, " if moe.num_shared_experts else ""
        out.append(
            f"MoE x TP: {shared}router and routed experts whole on each of the tp = {tp} ranks "
            f"(every TP rank computes the routed experts for all tokens of its data-parallel rank)"
        )
    return out
