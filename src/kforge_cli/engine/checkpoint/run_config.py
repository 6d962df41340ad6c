"""A run directory's saved ``config.toml`` versus new settings (for resume; imports no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kforge_cli.engine.checkpoint.errors import CheckpointError
from kforge_cli.engine.checkpoint.fingerprint import changed_fields, shaping_config
from kforge_cli.engine.checkpoint.layout import newest_complete
from kforge_cli.errors import KforgeError
from kforge_cli.files import read_toml_file
from kforge_cli.settings import JobSettings
from kforge_cli.settings.run_dir import checkpoint_root

CONFIG_FILE = "config.toml"


def read_saved_config(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/config.toml as a dict; a clear error when it is missing or unreadable."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: {run_dir} is not a kforge run directory (kforge train writes config.toml there)"
        )
    try:
        return read_toml_file(path, "saved config")
    except KforgeError as exc:
        raise CheckpointError(str(exc)) from None


def shaping_changes(old: JobSettings, new: JobSettings) -> list[str]:
    """`key: old -> new` for each model-shaping field that differs."""
    return changed_fields(shaping_config(old), shaping_config(new))


def conflicts_with_saved_config(settings: JobSettings, run_dir: Path) -> list[str]:
    """Shaping changes against RUN_DIR/config.toml when RUN_DIR has a checkpoint a resume would use.

    Empty when there is no saved config, no complete checkpoint, resume is 'never',
    or the shapes agree: then the new settings may replace config.toml.
    """
    path = Path(run_dir) / CONFIG_FILE
    if settings.checkpoint.resume == "never" or not path.is_file():
        return []
    root = checkpoint_root(settings, run_dir)
    if newest_complete(root)[0] is None:
        return []
    try:
        saved = JobSettings.model_validate(read_toml_file(path, "saved config"))
    except Exception:  # an unreadable or outdated file: keep it rather than lose it
        return [f"{path} could not be read as settings"]
    return shaping_changes(saved, settings)
