"""Running training from the CLI: the engine's outcome -> a message and an exit code.

The engine returns a `TrainOutcome` and never decides how a process exits; this module
(shared by `kforge train` and `kforge resume`) owns the user-facing messages and the exit
codes documented in the README (0 done, 75 stopped after a checkpoint, 1 stopped without; 76, a hang,
is the watchdog's own exit, see `engine.resilience.hang`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kforge_cli.errors import EXIT_FAILURE, EXIT_OK, EXIT_REQUEUE

if TYPE_CHECKING:
    from kforge_cli.engine.train import TrainOutcome
    from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")


def resume_hint(run_dir: object, hooks: Sequence[str] = ()) -> str:
    """How to continue a stopped run: requeue inside a SLURM job, `kforge resume RUN_DIR` elsewhere
    (with the ``--allow-hooks`` its saved settings need when they name hook modules)."""
    import os
    import shlex

    from kforge_cli.settings.hook_policy import allow_flag

    command = shlex.join(["kforge", "resume", str(run_dir), *allow_flag(hooks)])
    if os.environ.get("SLURM_JOB_ID"):
        return f"the job exits 75 so SLURM can requeue it (or continue with: {command})"
    return f"continue with: {command}"


def exit_code(outcome: TrainOutcome, hooks: Sequence[str] = ()) -> int:
    """Log how the run ended and return its exit code."""
    if outcome.status == "completed":
        loss = f"{outcome.last_loss:.4f}" if outcome.last_loss is not None else "n/a"
        steps = f"{outcome.step} step{'' if outcome.step == 1 else 's'}"
        log.info("training complete: %s, final loss %s, run dir %s", steps, loss, outcome.run_dir)
        return EXIT_OK
    if outcome.status != "stopped":  # a loop component ended the run (e.g. early stopping): done, not failed
        log.info(
            "training ended at step %d (%s): %s; run dir %s",
            outcome.step,
            outcome.status,
            outcome.reason,
            outcome.run_dir,
        )
        return EXIT_OK
    if outcome.checkpoint_saved:
        log.warning(
            "stopped by %s at step %d after saving a checkpoint: %s",
            outcome.signal,
            outcome.step,
            resume_hint(outcome.run_dir, hooks),
        )
        return EXIT_REQUEUE
    log.error(
        "stopped by %s at step %d; no checkpoint was saved, so this progress is lost", outcome.signal, outcome.step
    )
    return EXIT_FAILURE


def train_and_exit(settings: JobSettings) -> int:
    """Train per ``settings`` in this process and return the exit code (a rank of a multi-process
    job exits here at once, see `_exit_now`)."""
    import os
    import sys

    if (
        os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    ) == "0":  # PyTorch takes seconds to import: say so (once per job)
        print("kforge: starting (loading PyTorch) ...", file=sys.stderr, flush=True)
    from kforge_cli.engine.runtime import detect_launch
    from kforge_cli.engine.train import run_training

    code = exit_code(run_training(settings), settings.train.hooks)
    if detect_launch().world_size > 1:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Exit a distributed rank without interpreter teardown, after flushing every output.

    The process group is already destroyed and every file closed, but gloo/NCCL
    background threads can still abort the interpreter's teardown ("terminate called
    without an active exception"), turning a successful run into a crash exit code.
    """
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
