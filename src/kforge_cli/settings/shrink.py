"""Shrink instead of waiting (``slurm.min_nodes``): the layouts a job may run at a smaller world size.

With ``slurm.min_nodes`` set, the generated job asks SLURM for ``--nodes=MIN-MAX`` and starts on
the nodes it gets. ``kforge train`` then re-plans at start for the world size it has: tensor,
pipeline, context and expert parallelism, the schedule and the micro-batch are kept; the
data-parallel degree (``dp_replicate x dp_shard``) takes what remains, and gradient accumulation
keeps the global batch of the configured full size exactly::

    global batch = train.batch_size x train.grad_accum_steps x dp   (at slurm.nodes x gpus_per_node)

This module is the torch-free part: which world sizes the policy covers, the global batch it
keeps, and the candidate layouts (each checked by the rules of ``settings.rules``), or the
reason none can keep the global batch (exit 2). The planner's memory plan picks among them
(``engine.plan.shrink_replan``); the run's settings stay the configured ones (config.toml is never
rewritten), so each start re-plans toward the full size and a job that gets its nodes back grows
again. No torch, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings.job import JobSettings
from kforge_cli.settings.parallel_dims import ParallelDims
from kforge_cli.settings.rules import config_issues, resolve_dims, world_size_issues

POLICY = "slurm.min_nodes"


@dataclass(frozen=True)
class LayoutChoice:
    """The layout the shrink policy chose for this job, and the run's configured settings it came from."""

    configured: JobSettings  # the run's own settings (what config.toml records; the full size's layout)
    settings: JobSettings  # what this job runs: the configured settings, re-planned for world_size
    world_size: int
    full_world_size: int
    global_batch: int  # sequences per optimizer step, kept
    reason: str
    peak_bytes: int | None = None  # the memory plan's peak of the chosen layout (None: not planned)

    @property
    def shrunk(self) -> bool:
        return self.world_size < self.full_world_size


def shrink_enabled(settings: JobSettings) -> bool:
    """The policy is on: ``slurm.min_nodes`` is set below ``slurm.nodes``."""
    m = settings.slurm.min_nodes
    return m is not None and m < settings.slurm.nodes


def shrink_applies(settings: JobSettings, world_size: int) -> bool:
    """The policy re-plans this job: it is on and the job has fewer processes than the configured full size."""
    return shrink_enabled(settings) and world_size < settings.slurm.world_size


def describe_dims(dims: ParallelDims) -> str:
    """``dp_shard=2, tp=2`` (the dimensions above 1)."""
    named = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp}
    named |= {"tp": dims.tp, "ep": dims.ep}
    return ", ".join(f"{k}={v}" for k, v in named.items() if v != 1) or "no parallelism"


def full_size_dims(settings: JobSettings) -> ParallelDims:
    """The configured layout at the configured full size (slurm.nodes x slurm.gpus_per_node)."""
    full = settings.slurm.world_size
    try:
        return resolve_dims(settings, full)
    except ConfigError as exc:
        raise ConfigError(
            exc.issues,
            header=f"{POLICY}: the configured layout does not fit its own full size slurm.nodes x "
            f"slurm.gpus_per_node = {full}, so the global batch the shrink policy keeps is unknown",
            fix="make the distributed section fit slurm.nodes x slurm.gpus_per_node processes",
        ) from None


def global_batch(settings: JobSettings) -> int:
    """Sequences per optimizer step at the configured full size: what every re-planned layout keeps."""
    t = settings.train
    return t.batch_size * t.grad_accum_steps * full_size_dims(settings).dp


def _splits(dp: int, full: ParallelDims) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) with product ``dp``, in the policy's order of preference: the
    configured dp_shard kept (the same memory per rank), the configured dp_replicate kept, then
    the most sharded first (the least memory per rank)."""
    pairs = [(dp // s, s) for s in range(dp, 0, -1) if dp % s == 0]
    return sorted(pairs, key=lambda p: (p[1] != full.dp_shard, p[0] != full.dp_replicate, -p[1]))


def shrink_candidates(settings: JobSettings, world_size: int) -> list[JobSettings]:
    """The settings this job may run at ``world_size`` (fewer processes than the configured full size),
    best first; each keeps tp, pp, cp, ep, the schedule, the micro-batch and the global batch, and
    passes the rules. Raises ConfigError (exit 2) with the reason when none can.
    """
    full = full_size_dims(settings)
    t, d = settings.train, settings.distributed
    fixed = full.tp * full.pp * full.cp
    header = f"{POLICY}: cannot re-plan the job for its {world_size} process{'es' if world_size != 1 else ''}"
    sl = settings.slurm
    size = f"the configured {sl.world_size} processes (slurm.nodes={sl.nodes} x gpus_per_node={sl.gpus_per_node})"
    if world_size % fixed:
        raise ConfigError(
            [
                ConfigIssue(
                    "distributed",
                    f"tp x pp x cp = {full.tp} x {full.pp} x {full.cp} = {fixed} is kept and does not divide "
                    f"the world size {world_size} (of {size})",
                )
            ],
            header=header,
            fix=f"set slurm.min_nodes so that every node count from it to slurm.nodes gives a multiple of {fixed} "
            "processes",
        )
    dp = world_size // fixed
    gb = t.batch_size * t.grad_accum_steps * full.dp
    if gb % (t.batch_size * dp):
        raise ConfigError(
            [
                ConfigIssue(
                    "train.grad_accum_steps",
                    f"the global batch of {gb} sequences (train.batch_size {t.batch_size} x grad_accum_steps "
                    f"{t.grad_accum_steps} x {full.dp} data-parallel groups at {size}) cannot be kept exactly by "
                    f"{dp} data-parallel group{'s' if dp != 1 else ''} of micro-batch {t.batch_size}: "
                    f"{gb} / ({t.batch_size} x {dp}) is not a whole number of accumulation steps",
                )
            ],
            header=header,
            fix="set slurm.min_nodes so that every node count from it to slurm.nodes divides the global batch, "
            "or pick a global batch (train.batch_size x grad_accum_steps x dp) divisible by each",
        )
    accum = gb // (t.batch_size * dp)
    out: list[JobSettings] = []
    first_issues: list[ConfigIssue] = []
    for replicate, shard in _splits(dp, full):
        dist = d.model_copy(update={"dp_replicate": replicate, "dp_shard": shard})
        train = t.model_copy(update={"grad_accum_steps": accum})
        candidate = settings.model_copy(update={"distributed": dist, "train": train})
        issues = config_issues(candidate) + world_size_issues(candidate, world_size)
        if issues:
            first_issues = first_issues or issues
            continue
        out.append(candidate)
    if not out:
        raise ConfigError(first_issues, header=f"{header}: no data-parallel split passes the rules")
    return out


def unkept_node_counts(settings: JobSettings) -> list[int]:
    """Node counts below slurm.nodes that SLURM may start the job on (``--nodes=MIN-MAX``) where the
    policy cannot keep the global batch exactly (or the kept tp x pp x cp does not divide): the job
    would be refused at start. Arithmetic only (the rules and the memory plan are the job's)."""
    if not shrink_enabled(settings):
        return []
    try:
        full = resolve_dims(settings, settings.slurm.world_size)
    except ConfigError:  # reported by the rules themselves
        return []
    t, sl = settings.train, settings.slurm
    fixed, gb = full.tp * full.pp * full.cp, t.batch_size * t.grad_accum_steps * full.dp
    assert sl.min_nodes is not None  # shrink_enabled
    out = []
    for nodes in range(sl.min_nodes, sl.nodes):
        world = nodes * sl.gpus_per_node
        if world % fixed or gb % (t.batch_size * (world // fixed)):
            out.append(nodes)
    return out


def shrink_warnings(settings: JobSettings) -> list[ConfigIssue]:
    """A warning when SLURM may start the job on a node count the policy would refuse."""
    bad = unkept_node_counts(settings)
    if not bad:
        return []
    sl, gb = settings.slurm, global_batch(settings)
    listed = ", ".join(map(str, bad[:6])) + (", ..." if len(bad) > 6 else "")
    return [
        ConfigIssue(
            POLICY,
            f"SLURM may start the job on {listed} of its {sl.nodes} nodes (--nodes={sl.min_nodes}-{sl.nodes}), "
            f"where the global batch of {gb} sequences cannot be kept exactly: such a start is refused (exit 2) "
            f"instead of training; set slurm.min_nodes={bad[-1] + 1} (every count from it keeps the global batch), "
            "or a global batch divisible by train.batch_size x the data-parallel groups of every count",
        )
    ]


def check_world(settings: JobSettings, world_size: int) -> None:
    """Before a local job starts its processes: the settings fit ``world_size``, re-planned by the
    shrink policy where it applies (the memory plan is checked by the job itself)."""
    if shrink_applies(settings, world_size):
        shrink_candidates(settings, world_size)
    else:
        resolve_dims(settings, world_size)
