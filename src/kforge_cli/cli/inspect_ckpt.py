"""`kforge inspect-ckpt`: what is in a checkpoint, on CPU, without a process group."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("inspect-ckpt")(inspect_ckpt)


def inspect_ckpt(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory (RUN_DIR/checkpoints/step_N) or a run dir.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    tensor: Annotated[str | None, typer.Option("--tensor", help="Statistics of one tensor by name.")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Check the checkpoint is complete and readable.")] = False,
    diff: Annotated[Path | None, typer.Option("--diff", help="Compare with another checkpoint.")] = None,
) -> None:
    """Step, tokens, config summary and every tensor (shape, dtype, size, shards) of a checkpoint."""
    from kforge_cli.errors import NotBuiltYetError

    raise NotBuiltYetError("inspect-ckpt is not built yet (checkpoint inspection issue)")
