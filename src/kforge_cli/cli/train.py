"""`kforge train`: resolve the settings and run the training engine (or write an sbatch script)."""

from __future__ import annotations

from typing import Annotated

import typer

from kforge_cli.cli.common import OVERRIDES, ConfigOpt, ProfileOpt, RunDirOpt, SbatchOpt, SubmitOpt, resolve


def register(app: typer.Typer) -> None:
    app.command("train", context_settings=OVERRIDES)(train)


def train(
    ctx: typer.Context,
    profile: ProfileOpt = None,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option("--nproc-per-node", help="Start N local processes with torch's elastic launcher."),
    ] = None,
    sbatch: SbatchOpt = False,
    submit: SubmitOpt = False,
) -> None:
    """Train a model. With no arguments: the cpu-debug profile on the built-in corpus.

    Overrides follow the options: `kforge train -p h100x8 --optimizer.lr=1e-4`.
    An existing run directory resumes from its latest checkpoint. Exit codes: 0 done,
    1 failure, 2 invalid input, 75 stopped on a signal after a checkpoint (requeue).
    """
    overrides = list(ctx.args)
    if run_dir is not None:
        overrides.append(f"--train.run_dir={run_dir}")
    resolved = resolve(profile, config, overrides)
    if sbatch or submit or nproc_per_node:
        from kforge_cli.errors import NotBuiltYetError

        flag = "--sbatch/--submit" if (sbatch or submit) else "--nproc-per-node"
        raise NotBuiltYetError(f"train {flag} is not built yet (SLURM and launcher issues)")
    from kforge_cli.engine.train.entry import train_from_cli

    raise typer.Exit(train_from_cli(resolved))
