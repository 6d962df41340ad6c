"""`kforge eval`: held-out loss / perplexity and multiple-choice accuracy of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate)


def evaluate(
    ckpt: Annotated[
        Path, typer.Argument(help="A run dir, RUN_DIR/checkpoints/step_N, or a Hugging Face dir (an export-hf output).")
    ],
    task: Annotated[
        list[str] | None,
        typer.Option(
            "--task",
            "-t",
            help="heldout, heldout:PREPARED_DIR, FILE.jsonl (multiple choice), lm-eval:NAME or lm-eval:TASK.yaml "
            "(default: heldout).",
        ),
    ] = None,
    max_batches: Annotated[
        int | None,
        typer.Option(
            "--max-batches",
            min=1,
            help="Held-out: only the first N of training's eval batches (default: the whole validation split).",
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", min=1, hidden=True)] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many task examples.")] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="'byte' or a tokenizer.json.")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    track: Annotated[
        bool,
        typer.Option(
            "--track",
            help="Also append the results to the run's metrics.jsonl and the trackers its config.toml names "
            "(MLflow, TensorBoard; never ending their runs). Default: log nowhere.",
        ),
    ] = False,
    no_log: Annotated[bool, typer.Option("--no-log", hidden=True)] = False,  # the default now (see --track)
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    allow_hooks: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-hooks",
            help="Import these modules (comma-separated) that an lm-eval task YAML's !function tags name "
            "(Python beside the YAML or installed). Without it such a task is refused; built-in tasks need none.",
        ),
    ] = None,
    after_checkpoint: Annotated[bool, typer.Option("--after-checkpoint", hidden=True)] = False,  # eval.after_checkpoint
) -> None:
    """Score the checkpoint on each --task; results go to RUN_DIR/eval/step_N.json (and with --track to the
    run's metrics.jsonl and trackers)."""
    from kforge_cli.engine.evaluation.tasks import check_task, log_to_trackers, run_task, task_name, write_results
    from kforge_cli.engine.interop.open_checkpoint import open_for_inference

    tasks = task or ["heldout"]  # the run's own validation split
    cap = max_batches if max_batches is not None else steps
    if after_checkpoint:  # started by a training for one of its checkpoints: pin, status, no metrics.jsonl
        from kforge_cli.engine.evaluation.after_checkpoint import evaluate_after_checkpoint

        code = evaluate_after_checkpoint(
            ckpt, tasks, max_batches=cap, limit=limit, tokenizer=tokenizer, device=device, allow_hooks=allow_hooks
        )
        raise typer.Exit(code)
    for spec in tasks:  # printable names; a task file's bounds and code consent, before the checkpoint is loaded
        check_task(spec, allow_hooks)
    loaded = open_for_inference(ckpt, device=device, tokenizer=tokenizer)
    results = {
        task_name(spec): run_task(loaded, spec, max_batches=cap, limit=limit, allow_hooks=allow_hooks) for spec in tasks
    }
    path = write_results(loaded, results)
    logged = track and not no_log
    backends = log_to_trackers(loaded, results) if logged else []
    if as_json:
        typer.echo(json.dumps({"checkpoint": str(loaded.path), "step": loaded.step, "tasks": results}))
        return
    typer.echo(f"{'task':<24} {'metric':<12} {'value':>12}")
    for name, metrics in results.items():
        for metric, value in metrics.items():
            typer.echo(f"{name:<24} {metric:<12} {value:>12.6g}")
    for name, metrics in results.items():
        if "tokens" in metrics and "batches" in metrics:
            scope = "the whole validation split" if cap is None else f"the first {cap} eval batches (--max-batches)"
            typer.echo(f"{name}: {int(metrics['tokens']):,} tokens in {int(metrics['batches'])} batches, {scope}")
    if path is not None:
        where = f"; logged at step {loaded.step} to metrics.jsonl" + "".join(f", {b}" for b in backends[1:])
        typer.echo(f"wrote {path}{where if backends else ''}")
