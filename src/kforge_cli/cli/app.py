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
    data_trace,
    evaluate,
    export_hf,
    generate,
    inspect_ckpt,
    list_profiles,
    plan,
    plot,
    prepare_data,
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


for module in (train, resume, convert_mot, inspect_ckpt, export_hf, validate, plan, prepare_data):
    module.register(app)
for module in (generate, evaluate, plot, runs, data_trace, list_profiles):  # after training
    module.register(app)
apply_readable_help(app)  # docstrings -> whole paragraphs, brackets kept, no literal backticks


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turning errors into a message and an exit code.

    One error path for everything: a :class:`KforgeError` (the user's input or environment)
    and an ``OSError`` naming a file (permissions, a full disk, a path that is not there) print
    one message and exit with the error's code (2 for input); anything else is a kforge bug:
    its traceback is printed with where to report it (exit 1).
    """
    from kforge_cli.errors import EXIT_FAILURE, EXIT_INVALID_INPUT, KforgeError, bug_report_hint

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
    except OSError as exc:
        if exc.filename is None:
            _bug(exc, bug_report_hint())
            sys.exit(EXIT_FAILURE)
        names = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
        typer.echo(f"error: {names}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_INVALID_INPUT)
    except Exception as exc:
        if not _not_a_bug(exc):
            _bug(exc, bug_report_hint())
        sys.exit(EXIT_FAILURE)


def _not_a_bug(exc: Exception) -> bool:
    """Say what failed, for the failures that are the machine's, not kforge's: device memory (no
    traceback: the advice is what helps) and a collective that failed because another process of
    the job stopped (traceback kept: it says which collective). True when handled."""
    kind = type(exc).__name__
    if kind == "OutOfMemoryError":
        first = str(exc).splitlines()[0] if str(exc) else kind
        typer.echo(
            f"error: out of device memory ({first}). `kforge plan` estimates the memory per GPU; "
            "lower train.batch_size (raise train.grad_accum_steps to keep the batch), turn on "
            'train.activation_checkpointing = "full", or shard more (distributed.dp_shard, tp, pp)'
            + _oom_snapshot_note(),
            err=True,
        )
        return True
    if kind in ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError"):
        import traceback

        traceback.print_exception(exc)
        typer.echo(
            f"error: a collective failed ({kind}): another process of this job may have stopped first; "
            "its own log (RUN_DIR/logs/rank_N.log) says why",
            err=True,
        )
        return True
    return False


def _oom_snapshot_note() -> str:
    """Where training wrote the allocator's state at the error (engine/observe/memory_snapshot.py), if it did."""
    module = sys.modules.get("kforge_cli.engine.observe.memory_snapshot")  # loaded only by a training run
    path = module.oom_snapshot_path() if module is not None else None
    if path is None:
        return ""
    return f". The allocator's state at the error: {path} (open it at https://pytorch.org/memory_viz)"


def _bug(exc: BaseException, hint: str) -> None:
    import traceback

    traceback.print_exception(exc)
    typer.echo(
        f"kforge {__version__}: this is a kforge bug ({type(exc).__name__}), not a mistake of yours. {hint}", err=True
    )
