"""The `kforge` command: a Typer app whose subcommands live one per module.

User mistakes raise KforgeError; `main` prints them on one line (or a short list)
without a traceback and exits with the error's code (2 for invalid input).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kforge_cli import __version__
from kforge_cli.cli import (
    convert_mot,
    evaluate,
    export_hf,
    generate,
    inspect_ckpt,
    plot,
    prepare_data,
    profiles,
    resume,
    runs,
    train,
    validate,
)
from kforge_cli.cli.help_text import apply_readable_help, plain_metavars

app = typer.Typer(
    name="kforge",
    help="Pre-train LLMs and VLMs with PyTorch's native distributed stack, from a laptop CPU to a SLURM cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kforge {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """kforge: typed pre-training for LLMs and VLMs."""


for module in (train, resume, convert_mot, inspect_ckpt, export_hf, validate, prepare_data):
    module.register(app)
for module in (generate, evaluate, plot, runs, profiles):  # after training
    module.register(app)
apply_readable_help(app)  # docstrings -> whole paragraphs, brackets kept, no literal backticks


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turning KforgeError into a message and exit code."""
    from kforge_cli.errors import KforgeError

    try:
        command = typer.main.get_command(app)
        plain_metavars(command)
        command(args=argv, prog_name="kforge")
    except KforgeError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
