"""`--write-profile`: a layout the search found, as a profile file (also each trial's profile)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kforge_cli.errors import InvalidInputError


def write_best_profile(settings: Any, candidate: Any, path: Path, *, overwrite: bool) -> Path:
    """Write ``candidate`` as a profile extending the one ``settings`` came from (no link followed)."""
    from kforge_cli.files import atomic_write

    path = check_profile_target(path, overwrite=overwrite)
    atomic_write(path, candidate_profile(settings, candidate).encode())  # replaces a link, never follows it
    return path


def check_profile_target(path: Path, *, overwrite: bool) -> Path:
    """The --write-profile path, refused when it is no .toml, exists (without --overwrite) or has no directory."""
    path = Path(path).expanduser()
    if path.suffix != ".toml":
        raise InvalidInputError(f"--write-profile {path}: a profile file ends in .toml")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise InvalidInputError(f"--write-profile {path} exists; choose another file or pass --overwrite")
    if path.exists() and not path.is_file() and not path.is_symlink():
        raise InvalidInputError(f"--write-profile {path} is not a file")
    if not path.parent.is_dir():
        raise InvalidInputError(f"--write-profile {path}: directory {path.parent} does not exist")
    return path


def candidate_profile(settings: Any, candidate: Any) -> str:
    """The profile text of ``candidate`` (its layout and cluster shape over ``settings``)."""
    from kforge_cli.settings import load_settings
    from kforge_cli.settings.profile_writer import extends_name, profile_toml
    from kforge_cli.settings.profiles import DEFAULT_PROFILE

    base = load_settings(profile=settings.profile or DEFAULT_PROFILE, use_env=False).settings
    e = candidate.estimate
    n = candidate.dims.world_size
    gpu = settings.slurm.gpu_type
    description = (
        f"{candidate.layout.describe()} on {n} x {gpu}: predicted {e.step_s:.3g} s/step, "
        f"peak {candidate.peak_bytes / 2**30:.1f} GiB per GPU (kforge validate-config --plan --search)"
    )
    comment = [
        f"Written by `kforge validate-config --plan --search --write-profile` over {extends_name(settings)}.",
        "Check it: kforge validate-config --plan --profile THIS_FILE",
    ]
    return profile_toml(candidate.settings, base, description, comment)
