"""`kforge runs`: a table of the run directories under runs/ (or DIR). Imports no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from kforge_cli.cli.runs_table import RunRow


def register(app: typer.Typer) -> None:
    app.command("runs")(runs)


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _cells(r: RunRow, with_job: bool, with_evals: bool = False) -> tuple[str, ...]:
    cells = (
        r.name,
        r.profile or "-",
        f"{_count(r.steps_done)}/{_count(r.steps_planned)}",
        _loss(r.last_loss),
        _loss(r.eval_loss),
        r.latest_checkpoint or "-",
        r.status,
        r.last_update or "-",
    )
    cells = (*cells, r.evals or "-") if with_evals else cells
    return (*cells, r.slurm_job or "-") if with_job else cells


def runs(
    root: Annotated[Path, typer.Argument(help="The folder holding run directories.")] = Path("runs"),
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per run.")] = False,
) -> None:
    """Name, profile, steps done/planned, last loss, eval loss, latest checkpoint, status, last update.

    Status: running (its lock is held), done (exit 0), stopped (signal) (75), hung (watchdog)
    (76), interrupted (130), failed (another code), killed (the lock is free and the last job
    left no exit record). Runs written by --sbatch show their SLURM job's state
    (squeue/sacct when available): queued, running, not submitted, unknown, or the state SLURM
    ended it with. Steps: the newest complete checkpoint's or the last logged, whichever is later.

    Evals (when a run has eval.after_checkpoint evaluations): done/running/failed.
    """
    from kforge_cli.cli.runs_table import list_runs

    rows = list_runs(root)
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row.as_dict()))
        return
    with_job = any(r.slurm_job for r in rows)
    with_evals = any(r.evals for r in rows)  # eval.after_checkpoint: done/running/failed
    header = ("name", "profile", "steps", "loss", "eval_loss", "checkpoint", "status", "updated")
    header = (*header, "evals") if with_evals else header
    header = (*header, "job") if with_job else header
    right = {2, 3, 4}  # numbers line up on their last digit
    table = [_cells(r, with_job, with_evals) for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(header)]
    for line in (header, *table):
        cells = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        typer.echo("  ".join(cells).rstrip())
    if not table:
        typer.echo(f"(no run directories under {root})")
