"""The process groups a checkpoint uses, separate from the training collectives.

An async save runs DCP's collectives in a background thread. If that thread used the
default group, its collectives could interleave with the training loop's on the same
communicator and deadlock or corrupt both. So checkpointing gets its own gloo groups:
``save`` for DCP (per pipeline stage: each stage saves its own directory) and
``control`` (all ranks) for barriers and rank 0's broadcasts, used only from the main
thread and only while no save is in flight on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, cast

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kforge_cli.engine.runtime import RuntimeContext

_T = TypeVar("_T")


def _gloo_group(ranks: list[int] | None = None, *, backend: str = "gloo") -> ProcessGroup:
    """A new gloo group (collective); on ranks outside ``ranks`` the value is never used."""
    return cast(ProcessGroup, dist.new_group(ranks, backend=backend))


@dataclass
class CheckpointGroups:
    rank: int
    world_size: int
    stage: int = 0
    num_stages: int = 1
    control: ProcessGroup | None = None  # gloo over every rank: decisions, barriers
    save: ProcessGroup | None = None  # the ranks that write one DCP directory (one pipeline stage)

    @property
    def distributed(self) -> bool:
        return self.control is not None

    @classmethod
    def build(cls, runtime: RuntimeContext) -> CheckpointGroups:
        """Create the groups (collective: every rank calls this in the same order)."""
        if not runtime.distributed:
            return cls(rank=0, world_size=1)
        control = _gloo_group(backend="gloo")
        mesh = runtime.mesh
        names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
        if mesh is None or "pp" not in names or mesh["pp"].size() == 1:
            return cls(
                rank=runtime.rank, world_size=runtime.world_size, control=control, save=_gloo_group(backend="gloo")
            )
        dim = names.index("pp")
        stage, save = 0, None
        for s in range(mesh["pp"].size()):
            ranks = [int(r) for r in mesh.mesh.select(dim, s).flatten().tolist()]
            group = _gloo_group(ranks, backend="gloo")
            if runtime.rank in ranks:
                stage, save = s, group
        return cls(
            rank=runtime.rank,
            world_size=runtime.world_size,
            stage=stage,
            num_stages=mesh["pp"].size(),
            control=control,
            save=save,
        )

    def broadcast(self, obj: _T | None) -> _T:
        """Rank 0's `obj` on every rank (the others may pass None)."""
        if not self.distributed:
            return cast(_T, obj)  # one process: it is rank 0
        box: list[object] = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return cast(_T, box[0])  # pickled by rank 0 from its `obj`

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.control)

    def all_true(self, flag: bool) -> bool:
        """True when `flag` holds on every rank."""
        if not self.distributed:
            return flag
        box: list[object] = [None] * self.world_size
        dist.all_gather_object(box, flag, group=self.control)
        return all(box)
