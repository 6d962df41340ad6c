"""The shrink policy's re-plan at start (``slurm.min_nodes``): the layout for the world size the job got.

The candidates and the global batch they keep come from ``settings.shrink`` (the rules of
``settings.rules``); this module checks them with the memory plan the layout search uses
(``plan.search.memory_peak``: every pipeline rank's peak within ``slurm.gpu_memory_gb``) and
takes the first that fits. ``engine.train`` calls it before the process group starts, where the
world size is known (the fake process group of the memory plan needs it not to exist yet).
"""

from __future__ import annotations

import torch.distributed as dist

from kforge_cli.engine.plan.memory_items import GIB
from kforge_cli.engine.plan.param_shards import build_template
from kforge_cli.engine.plan.search import memory_peak
from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings import JobSettings, resolve_dims
from kforge_cli.settings.shrink import (
    POLICY,
    LayoutChoice,
    describe_dims,
    full_size_dims,
    global_batch,
    shrink_applies,
    shrink_candidates,
    shrink_enabled,
)


def replan_for_world(settings: JobSettings, world_size: int) -> LayoutChoice | None:
    """The shrink policy's layout for a job of ``world_size`` processes (None when the policy is off, or
    the job has more processes than the full size).

    At the configured full size the choice is the configured layout (a job that got its nodes
    back grows again); below it, the first candidate of ``settings.shrink`` whose memory plan
    fits. Raises ConfigError (exit 2) with the reason when the global batch cannot be kept or
    no candidate fits.
    """
    full = settings.slurm.world_size
    if not shrink_enabled(settings) or world_size > full:  # more than the full size: no shrink, the usual rules
        return None
    gb = global_batch(settings)
    if not shrink_applies(settings, world_size):
        return LayoutChoice(
            settings,
            settings,
            world_size,
            full,
            gb,
            f"the job has its configured {settings.slurm.nodes} nodes ({world_size} processes): the configured layout",
        )
    candidates = shrink_candidates(settings, world_size)
    capacity = int(settings.slurm.gpu_memory_gb * GIB)
    planned = not dist.is_initialized()  # a harness's own process group: the fake one of the plan cannot start
    template = build_template(settings) if planned else None
    rejected: list[ConfigIssue] = []
    for candidate in candidates:
        dims = resolve_dims(candidate, world_size)
        peak = memory_peak(candidate, world_size, template=template)[0] if planned else None
        if peak is not None and peak > capacity:
            rejected.append(
                ConfigIssue(
                    "slurm.gpu_memory_gb",
                    f"{describe_dims(dims)}: the memory plan's peak {_size(peak)} is above "
                    f"{settings.slurm.gpu_memory_gb:g} GB",
                )
            )
            continue
        old = full_size_dims(settings)
        t = settings.train
        nodes = world_size / settings.slurm.gpus_per_node
        reason = (
            f"{POLICY}: the job got {world_size} of {full} processes ({nodes:g} of {settings.slurm.nodes} nodes); "
            f"re-planned {describe_dims(old)} -> {describe_dims(dims)} (tp, pp, cp kept), global batch "
            f"{gb} sequences kept: train.grad_accum_steps {t.grad_accum_steps} -> {candidate.train.grad_accum_steps}"
        )
        if peak is not None:
            reason += f"; memory plan peak {_size(peak)} of {settings.slurm.gpu_memory_gb:g} GB"
        return LayoutChoice(settings, candidate, world_size, full, gb, reason, peak)
    raise ConfigError(
        rejected,
        header=f"{POLICY}: no layout for the job's {world_size} processes fits the GPU memory",
        fix=f"raise slurm.min_nodes so the job waits for more nodes, or lower the memory per rank "
        "(train.activation_checkpointing, a smaller train.batch_size with a larger grad_accum_steps); "
        f"check with: kforge plan --world-size {world_size}",
    )


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
