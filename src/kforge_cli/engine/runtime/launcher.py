"""Launcher detection: single process, torchrun, or SLURM's srun (one task per GPU).

Pure environment inspection (no torch) so it is cheap and unit-testable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Launcher = Literal["single", "torchrun", "srun"]


@dataclass(frozen=True)
class LaunchInfo:
    """Who started this process and where it sits in the job."""

    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[012-015,020],cpu1' -> 'gpu012'."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        return nodelist
    prefix, ranges = head.group(1), head.group(3)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def port_from_job_id(job_id: str) -> int:
    """A deterministic port in [15000, 25000) from the job id, so all tasks agree without talking."""
    digits = int(re.sub(r"\D", "", job_id) or "0")
    return 15000 + digits % 10000


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's environment. torchrun wins over srun (torchrun under srun is torchrun)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(
            launcher="torchrun",
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    ntasks = int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and ntasks > 1:
        job_id = env.get("SLURM_JOB_ID", "0")
        return LaunchInfo(
            launcher="srun",
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            world_size=ntasks,
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT") or port_from_job_id(job_id)),
        )
    return LaunchInfo("single", 0, 0, 1, "127.0.0.1", 0)
