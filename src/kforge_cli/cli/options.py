"""Options and helpers shared by subcommands (cheap to import: typer only)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:  # the settings model is imported only when a command runs (`kforge --help` stays fast)
    from kforge_cli.settings.config_layers import ResolvedSettings

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
AllowHooksOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-hooks",
        help="Import these train.hooks modules (comma-separated) although a file, not this command line, names "
        "them (a profile, --config, a run's config.toml). Without it such hooks are refused.",
    ),
]


def resolve(
    profile: str | None, config: Path | None, overrides: list[str], *, for_run: bool = False
) -> ResolvedSettings:
    """Load and validate the settings (imports pydantic only when a command runs); print its warnings."""
    from kforge_cli.settings import load_settings

    refuse_underscored_options(overrides)
    resolved = load_settings(profile=profile, config=config, overrides=overrides, for_run=for_run)
    for line in resolved.profile_origin():  # every run says which files its profile came from
        echo_err(line)
    print_warnings(resolved)
    return resolved


def refuse_underscored_options(args: list[str]) -> None:
    """``--nproc_per_node=2`` (torchrun's spelling) for this command's ``--nproc-per-node``, or a misspelt
    option (``--run-dri``): name the option meant (exit 2)."""
    from kforge_cli.errors import InvalidInputError

    try:  # typer >= 0.2x carries its own copy of click
        from typer._click.globals import get_current_context  # pyright: ignore[reportMissingImports]
    except ImportError:
        from click import get_current_context
    ctx = get_current_context(silent=True)
    if ctx is None:
        return
    options = {opt for param in ctx.command.params for opt in getattr(param, "opts", []) if opt.startswith("--")}
    for arg in args:
        name, sep, value = arg.partition("=")
        dashed = name.replace("_", "-")
        if arg.startswith("--") and "." not in name and dashed != name and dashed in options:
            fix = f"{dashed} {value}" if sep else dashed
            raise InvalidInputError(f"unexpected argument {arg!r}: did you mean {fix}?")
        close = difflib.get_close_matches(dashed, sorted(options), n=1, cutoff=0.8)
        if arg.startswith("--") and "." not in name and dashed not in options and close and not _a_key(name):
            fix = f"{close[0]} {value}" if sep else close[0]  # --run-dri: --run-dir, not --train.run_dir
            raise InvalidInputError(f"unexpected argument {arg!r}: did you mean {fix}?")


def _a_key(name: str) -> bool:
    """``--max_steps``: a setting's name without its section (the settings' own did-you-mean says which)."""
    from kforge_cli.settings.config_layers import suggest_key

    leaf = name.lstrip("-").replace("-", "_")
    key = suggest_key([leaf])
    return key is not None and key.rsplit(".", 1)[-1] == leaf


LOCAL_CHILD_ENV = "KFORGE_LOCAL_CHILD"  # set by `--nproc-per-node` for its processes (it printed the warnings)


def print_warnings(resolved: ResolvedSettings) -> None:
    """The settings' warnings, once per job: not again in each process of a multi-process launch."""
    import os

    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    if os.environ.get(LOCAL_CHILD_ENV) or rank != "0":
        return
    for issue in resolved.warnings:
        echo_err(f"warning: {issue}")


def echo_err(message: str) -> None:
    typer.echo(message, err=True)
