"""`kforge resume RUN_DIR`: continue a run with the config it was started with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kforge_cli.cli.options import OVERRIDES, SbatchOpt, SubmitOpt

if TYPE_CHECKING:
    from kforge_cli.settings import ResolvedSettings


def register(app: typer.Typer) -> None:
    app.command("resume", context_settings=OVERRIDES)(resume)


def resume(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Argument(help="The run directory to continue (holds config.toml).")],
    sbatch: SbatchOpt = False,
    submit: SubmitOpt = False,
) -> None:
    """Resume RUN_DIR from its latest complete checkpoint using its saved config.toml.

    Overrides that do not change the model's shape are allowed
    (e.g. --train.max_steps=20000); ones that do are refused (exit 2).
    """
    resolved = resolve_resume(run_dir, list(ctx.args))
    if sbatch or submit:  # a job that continues RUN_DIR (its config.toml takes the overrides)
        from kforge_cli.slurm import sbatch_from_cli

        raise typer.Exit(sbatch_from_cli(resolved.settings, submit=submit))
    from kforge_cli.cli.outcome import train_and_exit

    raise typer.Exit(train_and_exit(resolved.settings))


def resolve_resume(run_dir: Path, overrides: list[str]) -> ResolvedSettings:
    """The run's saved settings plus `overrides`; refuses overrides that change the model's shape.

    Without an explicit ``--checkpoint.resume`` the run must have a complete checkpoint
    (``require``): resuming nothing would silently start over.
    """
    from kforge_cli.engine.checkpoint.fingerprint import shaping_config, shaping_diff
    from kforge_cli.engine.checkpoint.run_config import CONFIG_FILE, read_saved_config
    from kforge_cli.errors import ConfigError, ConfigIssue
    from kforge_cli.settings import load_settings

    run_dir = run_dir.expanduser().resolve()
    saved = read_saved_config(run_dir)
    source = f"saved config {run_dir / CONFIG_FILE}"
    original = load_settings(base=saved, use_env=False, base_source=source).settings
    extra = [f"--train.run_dir={run_dir}"]
    if not any(a.startswith("--checkpoint.resume") for a in overrides):
        extra.append("--checkpoint.resume=require")
    resolved = load_settings(base=saved, overrides=[*overrides, *extra], base_source=source)
    diff = shaping_diff(shaping_config(original), shaping_config(resolved.settings))
    if diff:
        issues = [
            ConfigIssue(key, f"{old!r} -> {new!r} would change the model's shape [from {resolved.source_of(key)}]")
            for key, old, new in diff
        ]
        raise ConfigError(
            issues,
            header=f"cannot resume {run_dir}: overrides change the model's shape; drop them, or start a new run "
            f"from its weights with --checkpoint.init_from={run_dir}",
        )
    return resolved
