"""Vision-language export (placeholder, filled in below)."""

from __future__ import annotations

from typing import Any

from kforge_cli.engine.checkpoint.errors import CheckpointError
from kforge_cli.engine.checkpoint.reader import CheckpointView


def vlm_export_plan(view: CheckpointView) -> Any:
    raise CheckpointError(f"cannot export {view.path}: vision-language models are not exported yet")
