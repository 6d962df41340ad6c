"""`kforge plot`: loss (eval loss over it), lr, grad norm and tokens/s of one or more runs, as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer


def register(app: typer.Typer) -> None:
    app.command("plot")(plot)


def plot(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories (their metrics.jsonl), side by side.", metavar="RUN_DIR")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The PNG to write.")] = Path("curves.png"),
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help="Metrics to draw (repeatable; default loss, eval_loss, lr, grad_norm, tokens_per_sec).",
        ),
    ] = None,
    x: Annotated[
        Literal["step", "tokens", "time"],
        typer.Option("--x", help="The x axis: optimizer step, tokens seen, or training wall-clock time."),
    ] = "step",
    smooth: Annotated[
        float,
        typer.Option(
            "--smooth",
            help="Exponential moving average of the training curves, 0 (off) to 0.99; raw values stay faint.",
        ),
    ] = 0.0,
    log_y: Annotated[bool, typer.Option("--log-y", help="Logarithmic y axes (panels with positive values).")] = False,
    bits_per_byte: Annotated[
        bool,
        typer.Option(
            "--bits-per-byte",
            help="Losses in bits per byte of text (from the data's bytes per token), to compare tokenizers.",
        ),
    ] = False,
) -> None:
    """Draw the runs' curves from metrics.jsonl (a requeued run's repeated steps: the last record wins).

    One colour per run in every panel; the eval loss is drawn dashed over the training loss, and a
    dotted vertical line marks where a job resumed the run.
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from kforge_cli.errors import InvalidInputError
        from kforge_cli.settings.tracking_check import install_command

        raise InvalidInputError(f"kforge plot draws with matplotlib, which is not installed: {install_command('plot')}")
    from kforge_cli.engine.observe.curves import DEFAULT_METRICS, plot_runs

    scales = None
    if bits_per_byte:
        from kforge_cli.engine.evaluation.bits_per_byte import bytes_per_token

        scales = [bytes_per_token(Path(r)) for r in run_dirs]
    plot_runs(run_dirs, out, metric or list(DEFAULT_METRICS), x, smooth=smooth, log_y=log_y, bytes_per_token=scales)
    typer.echo(f"wrote {out}")
