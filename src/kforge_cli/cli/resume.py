"""`kforge resume RUN_DIR`: continue a run with the config it was started with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kforge_cli.cli.common import OVERRIDES, SbatchOpt, SubmitOpt


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
    from kforge_cli.errors import NotBuiltYetError

    raise NotBuiltYetError("resume is not built yet (checkpoint issue)")
