"""From the CLI to the engine: run training and map the outcome to an exit code."""

from __future__ import annotations

import logging

from kforge_cli.engine.train.recipe import run_training
from kforge_cli.errors import EXIT_FAILURE, EXIT_OK, EXIT_REQUEUE
from kforge_cli.settings import ResolvedSettings

log = logging.getLogger("kforge")


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
            "stopped by %s at step %d after saving a checkpoint: requeue to continue", outcome.signal, outcome.step
        )
        return EXIT_REQUEUE
    log.error(
        "stopped by %s at step %d; no checkpoint was saved, so this progress is lost", outcome.signal, outcome.step
    )
    return EXIT_FAILURE
