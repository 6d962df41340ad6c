"""`kforge plot`: loss, eval loss, lr, grad norm and tokens/s of one or more runs, as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("plot")(plot)


def plot(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (their metrics.jsonl), side by side.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The PNG to write.")] = Path("curves.png"),
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help="Metrics to draw (repeatable; default loss, eval_loss, lr, grad_norm, tokens_per_sec).",
        ),
    ] = None,
    x: Annotated[str, typer.Option("--x", help="step or tokens.")] = "step",
) -> None:
    """Draw the runs' curves from metrics.jsonl (a requeued run's repeated steps: the last record wins)."""
    from kforge_cli.engine.observe.curves import DEFAULT_METRICS, plot_runs

    plot_runs(run_dirs, out, metric or list(DEFAULT_METRICS), x)
    typer.echo(f"wrote {out}")
