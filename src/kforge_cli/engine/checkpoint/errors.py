"""Errors a checkpoint can cause: missing, incomplete, incompatible, or unsafe to open."""

from __future__ import annotations

from kforge_cli.errors import InvalidInputError


class CheckpointError(InvalidInputError):
    """A checkpoint cannot be used as asked (exit 2): the message names the path and the fix."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds more than plain data (it could run code when opened): refused, never executed."""
