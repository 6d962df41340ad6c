"""engine.runtime (layer 0): launcher detection, process group, device mesh, seeding."""

from kforge_cli.engine.runtime.context import (
    RuntimeContext,
    all_reduce_max,
    all_reduce_sum,
    choose_device,
    device_wait,
    init_runtime,
    process_group_timeout_s,
    rank_generator,
    resolve_backend,
    seed_everything,
    teardown_runtime,
)
from kforge_cli.engine.runtime.dtypes import DTYPES, dtype_name, torch_dtype_name
from kforge_cli.engine.runtime.launcher import LaunchInfo, detect_launch
from kforge_cli.engine.runtime.mesh import MESH_ORDER, build_mesh, mesh_shape

__all__ = [
    "DTYPES",
    "MESH_ORDER",
    "LaunchInfo",
    "RuntimeContext",
    "all_reduce_max",
    "all_reduce_sum",
    "build_mesh",
    "choose_device",
    "detect_launch",
    "device_wait",
    "dtype_name",
    "init_runtime",
    "mesh_shape",
    "process_group_timeout_s",
    "rank_generator",
    "resolve_backend",
    "seed_everything",
    "teardown_runtime",
    "torch_dtype_name",
]
