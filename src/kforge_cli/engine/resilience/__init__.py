"""engine.resilience (layer 1): NaN/Inf policy, graceful shutdown on signals, the hang watchdog,
the straggler report, the loss-spike guard."""

from kforge_cli.engine.resilience.hang import HangWatchdog, NullWatchdog, hang_dir
from kforge_cli.engine.resilience.hang_report import archive_previous
from kforge_cli.engine.resilience.nan_guard import NanGuard
from kforge_cli.engine.resilience.shutdown import ShutdownHandler, StopVote
from kforge_cli.engine.resilience.spike import SpikeEvent, SpikeGuard
from kforge_cli.engine.resilience.straggler import StragglerMonitor, local_parameter_count

__all__ = [
    "HangWatchdog",
    "NanGuard",
    "NullWatchdog",
    "ShutdownHandler",
    "SpikeEvent",
    "SpikeGuard",
    "StopVote",
    "StragglerMonitor",
    "archive_previous",
    "hang_dir",
    "local_parameter_count",
]
