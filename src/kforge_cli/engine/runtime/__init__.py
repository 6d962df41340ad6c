"""engine.runtime (layer 0): launcher detection, process group, device mesh, seeding."""

from kforge_cli.engine.runtime.context import (
    RuntimeContext,
    all_reduce_max,
    all_reduce_sum,
    init_runtime,
    seed_everything,
    teardown_runtime,
)
from kforge_cli.engine.runtime.launcher import LaunchInfo, detect_launch

__all__ = [
    "LaunchInfo",
    "RuntimeContext",
    "all_reduce_max",
    "all_reduce_sum",
    "detect_launch",
    "init_runtime",
    "seed_everything",
    "teardown_runtime",
]
