"""Errors a checkpoint can cause: missing, incomplete, incompatible, or unsafe to open.

``CheckpointError`` is defined in :mod:`kforge_cli.errors` (the run directory's torch-free
rules raise it too) and re-exported here for the engine.
"""

from __future__ import annotations

from kforge_cli.errors import CheckpointError

__all__ = ["CheckpointError", "UnsafeCheckpointError"]


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds more than plain data (it could run code when opened): refused, never executed."""
