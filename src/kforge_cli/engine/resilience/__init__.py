"""engine.resilience (layer 1): NaN/Inf policy and graceful shutdown on signals."""

from kforge_cli.engine.resilience.nan_guard import NanGuard
from kforge_cli.engine.resilience.shutdown import ShutdownHandler, StopVote

__all__ = ["NanGuard", "ShutdownHandler", "StopVote"]
