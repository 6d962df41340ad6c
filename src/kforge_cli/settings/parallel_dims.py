"""`ParallelDims`: the resolved device-mesh shape of a job (pp x dp_replicate x dp_shard x cp x tp, and ep).

`settings.rules.resolve_dims` makes one from the ``distributed`` section and the world size;
the engine's runtime builds the device mesh from it and the planner enumerates them. Plain
data: no torch, no engine (the settings package may not import either).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """The resolved device mesh shape."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1  # context parallel: ranks that split one sequence (they share a batch and, with FSDP, shards)
    ep: int = 1  # expert parallel: a split of dp_shard (dp_shard_mod_ep x ep); not a factor of world_size

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed per step."""
        return self.dp_replicate * self.dp_shard
