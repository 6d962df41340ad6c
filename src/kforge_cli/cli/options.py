"""Options and helpers shared by subcommands (cheap to import: typer only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

# Subcommands that accept `--section.key=value` overrides after their own options.
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}

ProfileOpt = Annotated[
    str | None,
    typer.Option("--profile", "-p", help="Profile name (profiles/NAME.toml) or a .toml path. Default: cpu-debug."),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config file applied on top of the profile."),
]
RunDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--run-dir", help="Run directory (default runs/<profile>[-<data>]-<timestamp>); an existing one resumes."
    ),
]
SbatchOpt = Annotated[
    bool, typer.Option("--sbatch", help="Write RUN_DIR/job.sbatch for SLURM and print it instead of training.")
]
SubmitOpt = Annotated[bool, typer.Option("--submit", help="With --sbatch: submit the script and print the job id.")]


def resolve(profile: str | None, config: Path | None, overrides: list[str], **kwargs: Any) -> Any:
    """Load and validate the settings (imports pydantic only when a command runs); print its warnings."""
    from kforge_cli.settings import load_settings

    resolved = load_settings(profile=profile, config=config, overrides=overrides, **kwargs)
    print_warnings(resolved)
    return resolved


def print_warnings(resolved: Any) -> None:
    for issue in resolved.warnings:
        echo_err(f"warning: {issue}")


def echo_err(message: str) -> None:
    typer.echo(message, err=True)
