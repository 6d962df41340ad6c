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
    from kforge_cli.engine.plan.search import format_search, search_layouts

    if trial < 0 or (trial and steps < 2):
        raise InvalidInputError(f"--trial needs K >= 1 and --steps N >= 2 (got --trial {trial} --steps {steps})")
    if sbatch and not trial:
        raise InvalidInputError("--sbatch with --search writes a trial sweep: give --trial K too")
    settings = resolved.settings
    if write_profile is not None:
        from kforge_cli.cli.plan_profile import check_profile_target

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
        from kforge_cli.cli.plan_profile import write_best_profile

        path = write_best_profile(settings, result.top[0], write_profile, overwrite=overwrite)
        typer.echo(f"wrote {path}: kforge validate-config --profile {path}", err=fmt == "json")
    if trial:
        from kforge_cli.cli.plan_trials import failed_trials, format_trials, run_trials

        results = run_trials(settings, result, result.top[:trial], steps, trial_dir)
        typer.echo(format_trials(results, steps), err=fmt == "json")
        failed = failed_trials(results)
        if failed:  # the command fails with them: a sweep's caller must not take a missing number for a result
            typer.echo(
                f"{len(failed)} of {len(results)} trials failed; see {', '.join(t.log for t in failed)}", err=True
            )
            raise typer.Exit(1)
