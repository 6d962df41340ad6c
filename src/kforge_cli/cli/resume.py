"""`kforge resume RUN_DIR`: continue a run with the config it was started with.

Also the rule for every later command on an existing run (`kforge train --run-dir RUN_DIR`,
either with `--sbatch`): the new settings are checked against the run's saved ones first,
nothing is written when they are refused, and accepted changes are recorded beside
config.toml, never over it (see `kforge_cli.rundir.saved_config`). Imports no torch.
"""

from __future__ import annotations

import shlex
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
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node",
            help="Start N local processes (default: as many as the run's last job, from RUN_DIR/launch.json).",
        ),
    ] = None,
) -> None:
    """Resume RUN_DIR from its latest complete checkpoint using its saved config.toml.

    Overrides that do not change the model's shape or the data order are allowed
    (e.g. --train.max_steps=20000) and recorded in RUN_DIR/config_changes.jsonl;
    config.toml itself is never rewritten. Ones that do are refused (exit 2).
    A run started with --nproc-per-node N resumes in N processes unless another N is typed
    (a typed change of the device mesh is allowed, warned about and recorded).
    """
    overrides = list(ctx.args)
    resolved = resolve_resume(run_dir, overrides, allow_hooks)
    refuse_before_start(resolved.settings, sbatch=sbatch or submit)
    if not (sbatch or submit):
        from kforge_cli.cli.local_job import launch_local_job, run_processes

        nproc = nproc_per_node if nproc_per_node is not None else run_processes(run_dir)
        if nproc is not None:
            from kforge_cli.settings.hook_policy import allow_flag
            from kforge_cli.settings.task_code import consented_code

            child = ["resume", str(run_dir), *allow_flag(consented_code(resolved.settings)), *overrides]
            raise typer.Exit(launch_local_job(resolved, nproc, child))
    continue_resolved(resolved, sbatch=sbatch, submit=submit)


def continue_resolved(resolved: ResolvedSettings, *, sbatch: bool, submit: bool) -> None:
    """Run (or write the job of) an accepted continuation."""
    if sbatch or submit:  # a job that continues RUN_DIR (its changes are recorded beside config.toml)
        from kforge_cli.slurm import sbatch_from_cli

        raise typer.Exit(sbatch_from_cli(resolved.settings, submit=submit))
    from kforge_cli.cli.outcome import train_and_exit

    raise typer.Exit(train_and_exit(resolved.settings))


def refuse_before_start(settings: JobSettings, *, sbatch: bool) -> None:
    """Before torch loads: a run whose lock a live process holds is refused ("in use", exit 2), and
    one already at its train.max_steps has nothing to do (exit 0, no banner, nothing written).
    A rank of a launched job does not probe the lock: rank 0 takes it itself."""
    from kforge_cli.rundir.launch import launched
    from kforge_cli.rundir.lock import refuse_in_use

    if not sbatch and not launched():  # a job script for a live run is refused by kforge_cli.slurm itself
        refuse_in_use(Path(settings.train.run_dir or "."))
    done = _already_done(settings)
    if done is not None:
        typer.echo(done, err=True)
        raise typer.Exit(0)


def _already_done(settings: JobSettings) -> str | None:
    """Why there is nothing to resume: the newest checkpoint is already at or past train.max_steps."""
    from kforge_cli.rundir.checkpoints import newest_complete, step_of
    from kforge_cli.rundir.layout import RunDir

    run_dir = Path(settings.train.run_dir or ".")
    newest, _ = newest_complete(RunDir(run_dir).checkpoint_root(settings))
    step = None if newest is None else step_of(newest)
    max_steps = settings.train.max_steps
    if step is None or step < max_steps:
        return None
    longer = f"to train longer: kforge resume {run_dir} --train.max_steps={step + max(1, max_steps)}"
    if step == max_steps:
        return f"{run_dir} already completed {step}/{max_steps} steps: nothing to do; {longer}"
    return (
        f"{run_dir} is already past train.max_steps={max_steps} (its newest checkpoint is step {step}): "
        f"nothing to do; {longer}"
    )


def resolve_resume(run_dir: Path, overrides: list[str], allow_hooks: list[str] | None = None) -> ResolvedSettings:
    """The run's saved settings plus `overrides`; refuses what its checkpoint cannot continue with.

    Without an explicit ``--checkpoint.resume`` the run must have a complete checkpoint
    (``require``): resuming nothing would silently start over. Hooks the saved config names
    are refused unless `allow_hooks` lists their modules (``settings.hook_policy``).
    """
    return resolve_continuation(run_dir, overrides, command="resume", allow_hooks=allow_hooks)


def resolve_continuation(
    run_dir: Path,
    overrides: list[str],
    *,
    command: str,
    profile: str | None = None,
    config: Path | None = None,
    allow_hooks: list[str] | None = None,
) -> ResolvedSettings:
    """Settings for a command on the existing run in `run_dir`, checked before anything is written.

    ``resume``, and ``train`` with no profile, config or override: the run's saved settings
    (config.toml plus its recorded changes) plus `overrides`. ``train`` with any of them: those
    settings as for a new run, refused where they differ from the run's in any setting the
    command line does not type, the layout (``distributed.*``) included: a default, a profile,
    a config file or the environment would silently change the run. What the user typed counts
    with what follows from it: ``dp_shard = -1`` takes its size from a typed
    ``--nproc-per-node``. The processes are the run's own unless typed (``kforge resume``
    starts the ``--nproc-per-node`` recorded in RUN_DIR/launch.json); a typed change of the
    device mesh is allowed (the checkpoint is resharded on load), reported as a WARNING and
    recorded in config_changes.jsonl by the job. A layout the shrink policy chooses at start
    (``slurm.min_nodes``: fewer processes than the full size) is the policy's, not a setting: the
    run's settings keep the configured layout, so it never differs here; the job reports it as a
    WARNING and records it, with its reason, in config_changes.jsonl. Either way, with a complete checkpoint the
    model's shape and the data order must stay. Each refusal names the run's value and the fix
    (exit 2).
    """
    from kforge_cli.errors import CheckpointError, ConfigError, ConfigIssue
    from kforge_cli.rundir.layout import RunDir
    from kforge_cli.rundir.saved_config import (
        continuation_issues,
        has_checkpoint,
        read_saved_config,
        settings_changes,
    )
    from kforge_cli.settings import load_settings

    run = RunDir(run_dir.expanduser().resolve())
    saved_raw = read_saved_config(run.path)
    source = f"saved config {run.config}" + (f" + {run.config_changes.name}" if run.config_changes.exists() else "")
    saved = load_settings(base=saved_raw, use_env=False, base_source=source).settings
    typed = [a for a in overrides if not a.startswith(("--train.run_dir", "--train.run-dir"))]
    as_new = command == "train" and bool(profile or config or typed)
    extra = [f"--train.run_dir={run.path}", f"--data.allow_changed_data={_allows_changed_data(typed)}"]
    if as_new:
        resolved = load_settings(profile=profile, config=config, overrides=[*typed, *extra], for_run=True)
    else:
        if command == "resume" and not any(a.startswith("--checkpoint.resume") for a in typed):
            extra.append("--checkpoint.resume=require")
        resolved = load_settings(base=saved_raw, overrides=[*typed, *extra], base_source=source, for_run=True)
    print_warnings(resolved)
    settings = resolved.settings
    checkpoint = has_checkpoint(run.path, settings)
    fix_prefix = ["kforge", "resume", str(run.path)] + ([] if checkpoint else ["--checkpoint.resume=auto"])
    if as_new:
        untyped = [
            ConfigIssue(key, f"{old!r} -> {new!r} (the run has {old!r}; this value comes from {where}, not typed)")
            for key, old, new in settings_changes(saved, settings)
            if not (where := resolved.source_of(key)).startswith("command line")
        ]
        if untyped:
            raise ConfigError(
                untyped,
                header=f"cannot continue {run.path} with these settings: kforge train on an existing run keeps the "
                "run's settings (model, data, optimizer, schedule, steps, layout, ...) and changes only what you type",
                fix=f"continue the run with its own settings and your overrides: {shlex.join(fix_prefix + typed)} ; "
                "or train with these settings in a new --run-dir",
            )
    issues = continuation_issues(saved, settings, checkpoint=checkpoint, source_of=resolved.source_of)
    if issues:
        raise ConfigError(
            issues,
            header=f"cannot continue {run.path}: its checkpoint holds another model or data order",
            fix=f"drop those overrides to continue it ({shlex.join(['kforge', 'resume', str(run.path)])}), or start "
            f"a new run from its weights with --checkpoint.init_from={run.path}",
        )
    if checkpoint and not settings.checkpoint.load_path and not settings.data.allow_changed_data:
        refuse_changed_data(run.checkpoint_root(settings), settings)
    if settings.checkpoint.resume == "require" and not checkpoint and not settings.checkpoint.load_path:
        root = run.checkpoint_root(settings)
        raise CheckpointError(
            f"nothing to resume: {root} holds no complete checkpoint. Start the run with its saved settings "
            f"(kforge train --run-dir {run.path}), or pass --checkpoint.resume=auto"
        )
    if checkpoint:
        warn_schedule_change(saved, settings)
    from kforge_cli.settings.hook_policy import refuse_unallowed_hooks

    refuse_unallowed_hooks(resolved, allow_hooks, f"kforge {command}")  # code named by a file: only when allowed
    if settings.eval.after_checkpoint:  # the evaluations it starts run task code only when allowed
        from kforge_cli.settings.task_code import refuse_unallowed_eval_code

        refuse_unallowed_eval_code(settings, allow_hooks, f"kforge {command}")
    return resolved


def _allows_changed_data(typed: list[str]) -> str:
    """``data.allow_changed_data`` for this command: as typed, else true when it types the data's path."""
    from kforge_cli.settings.config_layers import parse_overrides

    keys = {key: value for key, value in parse_overrides(typed)}
    if "data.allow_changed_data" in keys:
        return str(keys["data.allow_changed_data"]).lower()
    return "true" if {"data.path", "data.datasets"} & set(keys) else "false"


def refuse_changed_data(checkpoint_root: Path, settings: JobSettings) -> None:
    """Refuse (exit 2, before anything starts) a resume whose prepared data is not what the checkpoint
    trained on: the fingerprints it recorded against the data's now (metadata.json and shard sizes)."""
    from kforge_cli.errors import InvalidInputError
    from kforge_cli.rundir.checkpoints import newest_complete
    from kforge_cli.rundir.data_fingerprint import changed_data_message, checkpoint_data_fingerprints, data_fingerprints

    newest, _ = newest_complete(checkpoint_root)
    recorded = checkpoint_data_fingerprints(newest) if newest is not None else None
    current = data_fingerprints(settings)
    if recorded is None or current is None or recorded == current:
        return
    names = [d.name for d in settings.data.datasets] or None
    raise InvalidInputError(f"cannot continue from {newest}: " + changed_data_message(recorded, current, names))


def schedule_change_warning(saved: JobSettings, settings: JobSettings) -> str | None:
    """A warning when a continued run's new train.max_steps reshapes its learning-rate schedule.

    Cosine, linear and rex decay over every step after warmup and WSD's stable phase ends
    ``decay_steps`` before the last step, unless ``scheduler.decay_steps`` fixes the decay's length
    (not for WSD): the learning rate from the checkpoint on then follows the new length: a longer run
    may jump up where the old schedule had decayed, a shorter one decays faster.
    """
    old, new, sch = saved.train.max_steps, settings.train.max_steps, settings.scheduler
    if old == new or sch.name == "constant" or (sch.decay_steps is not None and sch.name != "wsd"):
        return None
    how = (
        "it rises again where the old schedule had decayed"
        if new > old
        else f"it decays faster from the checkpoint on, to its end at step {new}"
    )
    return (
        f"warning: train.max_steps {old} -> {new} reshapes the {sch.name} learning-rate schedule, which spans "
        f"train.max_steps: from the checkpoint on the learning rate follows the new length ({how})"
        + ("; set scheduler.decay_steps to keep the decay's length fixed" if sch.name != "wsd" else "")
    )


def warn_schedule_change(saved: JobSettings, settings: JobSettings) -> None:
    message = schedule_change_warning(saved, settings)
    if message:
        typer.echo(message, err=True)
