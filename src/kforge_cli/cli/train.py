"""`kforge train`: resolve the settings and run the training engine (or write an sbatch script)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kforge_cli.cli.options import OVERRIDES, ConfigOpt, ProfileOpt, RunDirOpt, SbatchOpt, SubmitOpt, resolve


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
) -> None:
    """Train a model. With no arguments: the cpu-debug profile on the built-in corpus.

    Overrides follow the options: `kforge train -p h100x8 --optimizer.lr=1e-4`.
    An existing run directory resumes from its latest checkpoint. Exit codes: 0 done,
    1 failure, 2 invalid input, 75 stopped on a signal after a checkpoint (requeue),
    76 stopped by the hang watchdog (requeue; RUN_DIR/logs/hang/summary.txt names the rank).
    """
    overrides = list(ctx.args)
    if run_dir is not None:
        overrides.append(f"--train.run_dir={run_dir}")
    resolved = resolve(profile, config, overrides, for_run=True)
    if sbatch or submit:  # --submit implies --sbatch
        from kforge_cli.slurm import sbatch_from_cli

        raise typer.Exit(sbatch_from_cli(resolved.settings, submit=submit))
    if nproc_per_node is not None:
        raise typer.Exit(_launch_local(resolved, nproc_per_node, profile, config, overrides))
    from kforge_cli.cli.outcome import train_and_exit

    raise typer.Exit(train_and_exit(resolved.settings))


def _launch_local(resolved: Any, nproc: int, profile: str | None, config: Path | None, overrides: list[str]) -> int:
    """Check the settings fit `nproc` processes, then start them (the same command minus the flag)."""
    from kforge_cli.settings import resolve_dims

    if nproc < 1:
        raise typer.BadParameter("--nproc-per-node must be at least 1")
    resolve_dims(resolved.settings, nproc)  # a ConfigError here beats N processes each printing it
    child = ["train"]
    if profile is not None:
        child += ["--profile", profile]
    if config is not None:
        child += ["--config", str(config)]
    from kforge_cli.engine.runtime.local_launch import launch_local

    return launch_local(nproc, [*child, *overrides])
