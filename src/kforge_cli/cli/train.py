"""`kforge train`: resolve the settings and run the training engine (or write an sbatch script)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kforge_cli.cli.options import (
    OVERRIDES,
    AllowHooksOpt,
    ConfigOpt,
    ProfileOpt,
    RunDirOpt,
    SbatchOpt,
    SubmitOpt,
    refuse_underscored_options,
    resolve,
)


def register(app: typer.Typer) -> None:
    app.command("train", context_settings=OVERRIDES)(train)


def train(
    ctx: typer.Context,
    profile: ProfileOpt = None,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node", help="Start N local processes (like torchrun); signals are forwarded to them."
        ),
    ] = None,
    sbatch: SbatchOpt = False,
    submit: SubmitOpt = False,
    allow_hooks: AllowHooksOpt = None,
) -> None:
    """Train a model. With no arguments: the cpu-debug profile on the built-in corpus.

    Overrides follow the options: `kforge train -p h100x8 --optimizer.lr=1e-4`.
    An existing run directory continues: alone (`kforge train --run-dir RUN`) like
    `kforge resume RUN` with the run's saved settings; with overrides, only what they type
    may differ from the run's (anything else is refused before a file is touched).

    Exit codes: 0 done, 1 failure, 2 invalid input, 75 stopped on a signal after a checkpoint,
    76 stopped by the hang watchdog (RUN_DIR/logs/hang/summary.txt names the rank); SLURM requeues 75 and 76.
    """
    overrides = list(ctx.args)
    refuse_underscored_options(overrides)  # before the overrides are parsed for a run directory
    if run_dir is not None:
        overrides.append(f"--train.run_dir={run_dir}")
    from kforge_cli.cli.local_job import launch_local_job, run_processes
    from kforge_cli.settings.hook_policy import allow_flag, refuse_unallowed_hooks

    existing = _existing_run(overrides)
    if existing is not None:  # a later command on a run: checked against the run's own settings first
        from kforge_cli.cli.resume import continue_resolved, resolve_continuation

        resolved = resolve_continuation(
            existing, overrides, command="train", profile=profile, config=config, allow_hooks=allow_hooks
        )
        from kforge_cli.cli.resume import refuse_before_start

        refuse_before_start(resolved.settings, sbatch=sbatch or submit)  # "in use", "already completed": no torch
        if nproc_per_node is None and not (sbatch or submit):
            nproc_per_node = run_processes(existing)  # the run's own --nproc-per-node unless typed
        if nproc_per_node is None or sbatch or submit:
            continue_resolved(resolved, sbatch=sbatch, submit=submit)
    else:
        resolved = resolve(profile, config, overrides, for_run=True)
        refuse_unallowed_hooks(resolved, allow_hooks, "kforge train")  # before anything of them is imported
        if resolved.settings.eval.after_checkpoint:  # the evaluations it starts run task code only when allowed
            from kforge_cli.settings.task_code import refuse_unallowed_eval_code

            refuse_unallowed_eval_code(resolved.settings, allow_hooks, "kforge train")
        if resolved.settings.train.run_dir and not (sbatch or submit):
            from kforge_cli.rundir.launch import launched
            from kforge_cli.rundir.lock import refuse_in_use

            if not launched():  # a run starting in that directory: "in use" before torch loads
                refuse_in_use(Path(resolved.settings.train.run_dir).expanduser())
    if sbatch or submit:  # --submit implies --sbatch
        from kforge_cli.slurm import sbatch_from_cli

        raise typer.Exit(sbatch_from_cli(resolved.settings, submit=submit))
    if nproc_per_node is not None:
        child = ["train", *(["--profile", profile] if profile is not None else [])]
        child += ["--config", str(config)] if config is not None else []
        from kforge_cli.settings.task_code import consented_code

        child += [*allow_flag(consented_code(resolved.settings)), *overrides]  # allowed above
        raise typer.Exit(launch_local_job(resolved, nproc_per_node, child))
    from kforge_cli.cli.outcome import train_and_exit

    raise typer.Exit(train_and_exit(resolved.settings))


def _existing_run(overrides: list[str]) -> Path | None:
    """The run directory the command names (its last --train.run_dir) when it holds a run's config.toml."""
    from kforge_cli.rundir.layout import RunDir
    from kforge_cli.settings.config_layers import parse_overrides

    named = [str(value) for key, value in parse_overrides(overrides) if key == "train.run_dir"]
    if not named:
        return None
    run = RunDir(Path(named[-1]).expanduser())
    run.refuse_foreign()  # a directory that is not a kforge run is never read as one
    return run.path if run.has_config() else None
