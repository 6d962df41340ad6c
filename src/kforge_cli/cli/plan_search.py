"""`validate-config --plan --search`: print the fastest layouts, write the best as a profile, run trials."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from kforge_cli.errors import InvalidInputError


def search_command(
    resolved: Any,
    world_size: int,
    *,
    fmt: str | None,
    mfu: float | None,
    top: int,
    global_batch: int | None,
    memory_share: float,
    write_profile: Path | None,
    overwrite: bool,
    trial: int,
    steps: int,
    trial_dir: Path | None,
    sbatch: bool,
    argv: list[str],
) -> None:
    """Search, print, then write the profile and run (or script) the trials the options ask for."""
    from kforge_cli.engine.parallel.plan.search import format_search, search_layouts

    if trial < 0 or (trial and steps < 2):
        raise InvalidInputError(f"--trial needs K >= 1 and --steps N >= 2 (got --trial {trial} --steps {steps})")
    if sbatch and not trial:
        raise InvalidInputError("--sbatch with --search writes a trial sweep: give --trial K too")
    settings = resolved.settings
    if write_profile is not None:
        check_profile_target(write_profile, overwrite=overwrite)  # before the search, not after it
    if sbatch:  # before searching: the job itself searches, inside its allocation
        from kforge_cli.cli.plan_trials import write_sweep_script

        write_sweep_script(settings, argv, trial_dir)
        return
    result = search_layouts(
        settings, world_size, top=max(top, trial), global_batch=global_batch, mfu=mfu, memory_share=memory_share
    )
    if fmt == "json":
        data = result.as_dict()
        data["top"] = data["top"][:top]
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(format_search(result, top))
    if not result.top:
        raise typer.Exit(1)
    if write_profile is not None:
        path = write_best_profile(settings, result.top[0], write_profile, overwrite=overwrite)
        typer.echo(f"wrote {path}: kforge validate-config --profile {path}", err=fmt == "json")
    if trial:
        from kforge_cli.cli.plan_trials import format_trials, run_trials

        results = run_trials(settings, result, result.top[:trial], steps, trial_dir)
        typer.echo(format_trials(results, steps), err=fmt == "json")


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
