"""`kforge plan search --write-profile`: the best layout as a profile file (the text: engine.plan.written_profile)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kforge_cli.errors import InvalidInputError


def write_best_profile(settings: Any, candidate: Any, path: Path, *, overwrite: bool) -> Path:
    """Write ``candidate`` as a profile extending the one ``settings`` came from (no link followed)."""
    from kforge_cli.common.files import atomic_write
    from kforge_cli.engine.plan.written_profile import candidate_profile

    path = check_profile_target(path, overwrite=overwrite)
    atomic_write(path, candidate_profile(settings, candidate).encode())  # replaces a link, never follows it
    return path


def check_profile_target(path: Path, *, overwrite: bool, option: str = "--write-profile") -> Path:
    """The path to write, refused when it is no .toml, exists (without --overwrite) or has no directory."""
    path = Path(path).expanduser()
    if path.suffix != ".toml":
        raise InvalidInputError(f"{option} {path}: a profile file ends in .toml")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise InvalidInputError(f"{option} {path} exists; choose another file or pass --overwrite")
    if path.exists() and not path.is_file() and not path.is_symlink():
        raise InvalidInputError(f"{option} {path} is not a file")
    if not path.parent.is_dir():
        raise InvalidInputError(f"{option} {path}: directory {path.parent} does not exist")
    return path
