"""The layouts `kforge plan search` enumerates: a mesh, a pipeline schedule and stage
split, a micro-batch with the accumulation that keeps the global batch, and an activation
checkpointing mode (see ``plan.search`` for how they are predicted, checked and ranked).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kforge_cli.errors import ConfigError, InvalidInputError
from kforge_cli.settings import JobSettings, ParallelDims, resolve_dims
from kforge_cli.settings.pipeline_schedules import SCHEDULES

AC_MODES: tuple[tuple[str, str], ...] = (
    ("none", "block"),
    ("selective", "op"),
    ("selective", "block"),
    ("full", "block"),
)
MAX_STAGES_PER_RANK = 8


@dataclass(frozen=True)
class Layout:
    """One point of the search space: the settings a layout changes."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    pp_schedule: str
    pp_stages_per_rank: int
    batch_size: int
    grad_accum_steps: int
    activation_checkpointing: str
    ac_selective_mode: str

    def distributed(self) -> dict[str, object]:
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "ep": self.ep,
            "pp_schedule": self.pp_schedule,
            "pp_stages_per_rank": self.pp_stages_per_rank,
        }

    def train(self) -> dict[str, object]:
        return {
            "batch_size": self.batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "activation_checkpointing": self.activation_checkpointing,
            "ac_selective_mode": self.ac_selective_mode,
        }

    def family(self) -> tuple[int | str, ...]:
        """The mesh and schedule (what the report lists once, with its best stage split, micro-batch and AC)."""
        return (self.tp, self.cp, self.pp, self.pp_schedule, self.ep)

    def overrides(self) -> list[str]:
        """The layout as ``--section.key=value`` overrides."""
        out = [f"--distributed.{k}={v}" for k, v in self.distributed().items()]
        return out + [f"--train.{k}={v}" for k, v in self.train().items()]

    @property
    def ac(self) -> str:
        if self.activation_checkpointing == "selective":
            return f"selective/{self.ac_selective_mode}"
        return self.activation_checkpointing

    def describe(self) -> str:
        mesh = [f"tp={self.tp}"] if self.tp > 1 else []
        if self.cp > 1:
            mesh.append(f"cp={self.cp}")
        if self.pp > 1:
            v = f" v={self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else ""
            mesh.append(f"pp={self.pp} {self.pp_schedule}{v}")
        if self.dp_replicate > 1:
            mesh.append(f"dp_replicate={self.dp_replicate}")
        mesh.append(f"dp_shard={self.dp_shard}" + (f" (ep={self.ep})" if self.ep > 1 else ""))
        return f"{' x '.join(mesh)}; micro-batch {self.batch_size} x {self.grad_accum_steps}, AC {self.ac}"


def _divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in O(sqrt(n))."""
    import math

    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def global_batch_of(settings: JobSettings, world_size: int) -> int:
    """Sequences per optimizer step of the profile's own layout (at ``world_size``, else at its slurm size)."""
    t = settings.train
    for world in (world_size, settings.slurm.world_size):
        try:
            dims = resolve_dims(settings, world)
        except ConfigError:
            continue
        return t.batch_size * t.grad_accum_steps * dims.dp
    raise InvalidInputError(
        f"the profile's own layout fits neither world size {world_size} nor its slurm size "
        f"{settings.slurm.world_size}, so its global batch is unknown: give --global-batch SEQUENCES"
    )


def cluster_shape(settings: JobSettings, world_size: int) -> tuple[int, int]:
    """(slurm.nodes, slurm.gpus_per_node) of a job of ``world_size`` processes on this profile's nodes."""
    gpn = settings.slurm.gpus_per_node
    if world_size % gpn == 0:
        return world_size // gpn, gpn
    if world_size < gpn:
        return 1, world_size
    raise InvalidInputError(
        f"--world-size {world_size} is not a multiple of slurm.gpus_per_node ({gpn}): give whole nodes"
    )


def _schedules(pp: int, n_layers: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        return
    for name, facts in SCHEDULES.items():
        if facts.v_shaped:
            if 2 * pp <= n_layers:
                yield name, 2
        elif facts.multi_stage:
            for v in range(2, MAX_STAGES_PER_RANK + 1):
                if pp * v <= n_layers:
                    yield name, v
        else:
            yield name, 1


def layouts(settings: JobSettings, world_size: int, global_batch: int) -> Iterator[list[tuple[Layout, ...]]]:
    """Every layout, grouped: per mesh and schedule a list over micro-batch sizes (ascending), each a
    tuple over AC modes (cheapest first, least memory last).

    A cheap pre-filter skips what cannot divide (the rules check every layout that is kept).
    """
    m, t, d = settings.model, settings.train, settings.distributed
    gpn = settings.slurm.gpus_per_node
    for tp in _divisors(world_size):
        if world_size > gpn and tp > gpn:
            continue
        for cp in _divisors(world_size // tp):
            if t.seq_len % (2 * cp) and cp > 1:
                continue
            for pp in _divisors(world_size // (tp * cp)):
                if pp > m.n_layers:
                    continue
                dp = world_size // (tp * cp * pp)
                if global_batch % dp:
                    continue
                schedules = list(_schedules(pp, m.n_layers)) or [(d.pp_schedule, d.pp_stages_per_rank)]
                for schedule, v in schedules:
                    modes = AC_MODES[:1] if pp > 1 and SCHEDULES[schedule].zero_bubble else AC_MODES
                    for dp_replicate in _divisors(dp):
                        dp_shard = dp // dp_replicate
                        eps = [1]
                        if m.moe is not None:
                            eps += [e for e in _divisors(dp_shard) if e > 1 and m.moe.num_experts % e == 0]
                        for ep in eps:
                            groups = []
                            for micro in _divisors(global_batch // dp):
                                accum = global_batch // (dp * micro)
                                if pp > 1 and accum < pp:
                                    continue
                                groups.append(
                                    tuple(
                                        Layout(
                                            dp_replicate,
                                            dp_shard,
                                            tp,
                                            pp,
                                            cp,
                                            ep,
                                            schedule,
                                            v,
                                            micro,
                                            accum,
                                            ac,
                                            mode if ac == "selective" else t.ac_selective_mode,
                                        )
                                        for ac, mode in modes
                                    )
                                )
                            yield groups


def with_layout(settings: JobSettings, layout: Layout, nodes: int, gpus_per_node: int) -> JobSettings:
    """``settings`` with the layout applied (and the cluster shape of the world size)."""
    dist = settings.distributed.model_copy(update=layout.distributed())
    train = settings.train.model_copy(update=layout.train())
    slurm = settings.slurm.model_copy(update={"nodes": nodes, "gpus_per_node": gpus_per_node})
    return settings.model_copy(update={"distributed": dist, "train": train, "slurm": slurm})


def layout_of(settings: JobSettings, dims: ParallelDims) -> Layout:
    """The :class:`Layout` ``settings`` already has at ``dims``."""
    d, t = settings.distributed, settings.train
    return Layout(
        dims.dp_replicate,
        dims.dp_shard,
        dims.tp,
        dims.pp,
        dims.cp,
        dims.ep,
        d.pp_schedule,
        d.pp_stages_per_rank,
        t.batch_size,
        t.grad_accum_steps,
        t.activation_checkpointing,
        t.ac_selective_mode,
    )
