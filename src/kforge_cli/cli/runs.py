"""`kforge runs`: a table of the run directories under runs/ (or DIR)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("runs")(runs)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def runs(
    root: Annotated[Path, typer.Argument(help="The folder holding run directories.")] = Path("runs"),
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per run.")] = False,
) -> None:
    """Name, profile, steps done/planned, last loss, eval loss, latest checkpoint, status, last update."""
    from kforge_cli.cli.runs_table import list_runs

    rows = list_runs(root)
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row.as_dict()))
        return
    header = ("name", "profile", "steps", "loss", "eval_loss", "checkpoint", "status", "updated")
    table = [
        (
            r.name,
            _fmt(r.profile),
            f"{_fmt(r.steps_done)}/{_fmt(r.steps_planned)}",
            _fmt(r.last_loss),
            _fmt(r.eval_loss),
            _fmt(r.latest_checkpoint),
            r.status,
            _fmt(r.last_update),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(header)]
    for line in (header, *table):
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    if not table:
        typer.echo(f"(no run directories under {root})")
