"""From the CLI to the engine: run training and map the outcome to an exit code."""

from __future__ import annotations

import logging
import os

from kforge_cli.engine.train.recipe import run_training
from kforge_cli.errors import EXIT_FAILURE, EXIT_OK, EXIT_REQUEUE
from kforge_cli.settings import ResolvedSettings

log = logging.getLogger("kforge")


def resume_hint(run_dir: object) -> str:
    """How to continue a stopped run: requeue inside a SLURM job, `kforge resume RUN_DIR` elsewhere."""
    command = f"kforge resume {run_dir}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"the job exits 75 so SLURM can requeue it (or continue with: {command})"
    return f"continue with: {command}"


def train_from_cli(resolved: ResolvedSettings) -> int:
    """Exit code: 0 completed, 75 stopped on a signal after a checkpoint, 1 stopped without one."""
    outcome = run_training(resolved.settings)
    if outcome.status == "completed":
        loss = f"{outcome.last_loss:.4f}" if outcome.last_loss is not None else "n/a"
        log.info(
            "training complete: %d steps, final loss %s, run dir %s",
            outcome.step,
            loss,
            resolved.settings.train.run_dir,
        )
        return EXIT_OK
    if outcome.checkpoint_saved:
        log.warning(
            "stopped by %s at step %d after saving a checkpoint: %s",
            outcome.signal,
            outcome.step,
            resume_hint(resolved.settings.train.run_dir),
        )
        return EXIT_REQUEUE
    log.error(
        "stopped by %s at step %d; no checkpoint was saved, so this progress is lost", outcome.signal, outcome.step
    )
    return EXIT_FAILURE
