"""`kforge resume RUN_DIR`: continue a run with the config it was started with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kforge_cli.cli.options import OVERRIDES, AllowHooksOpt, SbatchOpt, SubmitOpt, print_warnings

if TYPE_CHECKING:
    from kforge_cli.settings import JobSettings, ResolvedSettings


def register(app: typer.Typer) -> None:
    app.command("resume", context_settings=OVERRIDES)(resume)


def resume(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Argument(help="The run directory to continue (holds config.toml).")],
    sbatch: SbatchOpt = False,
    submit: SubmitOpt = False,
    allow_hooks: AllowHooksOpt = None,
) -> None:
    """Resume RUN_DIR from its latest complete checkpoint using its saved config.toml.

    Overrides that do not change the model's shape are allowed
    (e.g. --train.max_steps=20000); ones that do are refused (exit 2).
    """
    resolved = resolve_resume(run_dir, list(ctx.args), allow_hooks)
    done = _already_done(resolved.settings)
    if done is not None:
        typer.echo(done, err=True)
        raise typer.Exit(0)
    if sbatch or submit:  # a job that continues RUN_DIR (its config.toml takes the overrides)
        from kforge_cli.slurm import sbatch_from_cli

        raise typer.Exit(sbatch_from_cli(resolved.settings, submit=submit))
    from kforge_cli.cli.outcome import train_and_exit

    raise typer.Exit(train_and_exit(resolved.settings))


def _already_done(settings: JobSettings) -> str | None:
    """Why there is nothing to resume: the newest checkpoint is already at or past train.max_steps."""
    from kforge_cli.engine.checkpoint.layout import newest_complete, step_of
    from kforge_cli.settings.run_dir import checkpoint_root

    run_dir = Path(settings.train.run_dir or ".")
    newest, _ = newest_complete(checkpoint_root(settings, run_dir))
    step = None if newest is None else step_of(newest)
    max_steps = settings.train.max_steps
    if step is None or step < max_steps:
        return None
    where = "already past" if step > max_steps else "already at"
    return (
        f"{run_dir} is {where} train.max_steps={max_steps} (its newest checkpoint is step {step}): nothing to do. "
        f"To train further, raise it: kforge resume {run_dir} --train.max_steps={step + max(1, max_steps)}"
    )


def resolve_resume(run_dir: Path, overrides: list[str], allow_hooks: list[str] | None = None) -> ResolvedSettings:
    """The run's saved settings plus `overrides`; refuses overrides that change the model's shape.

    Without an explicit ``--checkpoint.resume`` the run must have a complete checkpoint
    (``require``): resuming nothing would silently start over. Hooks the saved config names
    are refused unless `allow_hooks` lists their modules (``settings.hook_policy``).
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
    resolved = load_settings(base=saved, overrides=[*overrides, *extra], base_source=source, for_run=True)
    print_warnings(resolved)
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
    from kforge_cli.settings.hook_policy import refuse_unallowed_hooks

    refuse_unallowed_hooks(resolved, allow_hooks, "kforge resume")  # code named by a file: only when allowed
    return resolved
