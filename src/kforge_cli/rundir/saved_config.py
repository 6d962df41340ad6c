"""A run directory's saved ``config.toml`` versus new settings (for resume; imports no torch)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from kforge_cli.errors import CheckpointError
from kforge_cli.rundir.checkpoints import newest_complete
from kforge_cli.rundir.fingerprint import changed_fields, shaping_config
from kforge_cli.rundir.layout import checkpoint_root
from kforge_cli.settings import JobSettings

CONFIG_FILE = "config.toml"


def read_saved_config(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/config.toml as a dict; a clear error when it is missing or unreadable."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: {run_dir} is not a kforge run directory (kforge train writes config.toml there)"
        )
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid TOML ({exc})") from None


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
        saved = JobSettings.model_validate(tomllib.loads(path.read_text()))
    except Exception:  # an unreadable or outdated file: keep it rather than lose it
        return [f"{path} could not be read as settings"]
    return shaping_changes(saved, settings)
