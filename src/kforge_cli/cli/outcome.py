"""Running training from the CLI: the engine's outcome -> a message and an exit code.

The engine returns a `TrainOutcome` and never decides how a process exits; this module
(shared by `kforge train` and `kforge resume`) owns the user-facing messages and the exit
codes documented in the README (0 done, 75 stopped after a checkpoint, 1 stopped without; 76, a hang,
is the watchdog's own exit, see `engine.resilience.hang`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kforge_cli.errors import EXIT_FAILURE, EXIT_HANG, EXIT_INTERRUPTED, EXIT_OK, EXIT_REQUEUE

if TYPE_CHECKING:
    from kforge_cli.engine.train import TrainOutcome
    from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")


def resume_command(run_dir: object, hooks: Sequence[str] = (), env: Mapping[str, str] | None = None) -> str:
    """The command that continues the run as it ran: the same processes per node and launcher.

    `kforge train --nproc-per-node N` gets ``kforge resume RUN --nproc-per-node N``; a
    single-node torchrun job ``torchrun --nproc-per-node=N -m kforge_cli resume RUN``; a job
    of several nodes names the launcher to rerun on each (with the ``--allow-hooks`` its saved
    settings need when they name hook modules).
    """
    import shlex
    import sys

    from kforge_cli.rundir.launch import launch_of_env
    from kforge_cli.settings.hook_policy import allow_flag

    launch = launch_of_env(env)
    nproc, world = launch["nproc_per_node"], launch["world_size"]
    resume = ["resume", str(run_dir), *allow_flag(hooks)]
    if launch["launcher"] == "local":
        return shlex.join(["kforge", *resume, "--nproc-per-node", str(nproc)])
    if launch["launcher"] == "torchrun" and nproc == world:
        return shlex.join(["torchrun", f"--nproc-per-node={nproc}", "-m", "kforge_cli", *resume])
    if launch["launcher"] != "single":
        how = f"{launch['launcher']} on {world} processes ({nproc} per node), each running"
        return f"{how}: {shlex.join([sys.executable, '-m', 'kforge_cli', *resume])}"
    return shlex.join(["kforge", *resume])


def resume_hint(run_dir: object, hooks: Sequence[str] = ()) -> str:
    """How to continue a stopped run: requeue inside a SLURM job, the command of `resume_command` elsewhere."""
    import os

    command = resume_command(run_dir, hooks)
    if os.environ.get("SLURM_JOB_ID"):
        return f"the job exits 75 so SLURM can requeue it (or continue with: {command})"
    return f"continue with: {command}"


def exit_code(outcome: TrainOutcome, hooks: Sequence[str] = (), *, main: bool = True) -> int:
    """Log how the run ended and return its exit code (the console message from rank 0 only:
    the other ranks keep it in their logs/rank_N.log)."""
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
        log.log(
            logging.WARNING if main else logging.INFO,
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


def record_job_exit(settings: JobSettings, code: int) -> None:
    """The `--nproc-per-node` launcher: the job's own exit code into RUN_DIR/exit.json, over rank 0's
    (another rank may have failed or hung); only for a job that ended there (rank 0 wrote its record)
    or hung (the hung rank exits by itself, maybe rank 0)."""
    from pathlib import Path

    from kforge_cli.rundir.launch import read_exit, write_exit

    if not settings.train.run_dir:
        return  # a default run directory: only rank 0 knows it, and it wrote the record
    run_dir = Path(settings.train.run_dir).expanduser()
    previous = read_exit(run_dir)
    if previous is not None or code == EXIT_HANG:
        step = previous.get("step") if previous is not None else None
        write_exit(run_dir, code, step if isinstance(step, int) else None)


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
    from kforge_cli.errors import KforgeError, SavedInterrupt
    from kforge_cli.rundir.claim import claimed_run_dir
    from kforge_cli.rundir.launch import write_exit

    def record(code: int, step: int | None = None) -> None:
        claimed = claimed_run_dir()  # rank 0 of a job that took the run directory (not one refused "in use")
        if claimed is not None:
            write_exit(claimed, code, step)

    launch = detect_launch()
    try:
        outcome = run_training(settings)
    except SavedInterrupt as exc:  # a second Ctrl-C once the stop's checkpoint was complete: nothing is lost
        record(EXIT_REQUEUE, exc.step)
        if launch.rank == 0:
            print(
                f"kforge: interrupted after the checkpoint of step {exc.step} was saved: the run resumes from it",
                file=sys.stderr,
                flush=True,
            )
        if launch.world_size > 1:
            _exit_now(EXIT_REQUEUE)
        return EXIT_REQUEUE
    except KeyboardInterrupt:
        record(EXIT_INTERRUPTED)
        raise
    except KforgeError as exc:
        record(exc.exit_code)
        raise
    except BaseException:
        record(EXIT_FAILURE)
        raise
    from kforge_cli.settings.task_code import consented_code

    code = exit_code(outcome, consented_code(settings), main=launch.rank == 0)
    record(code, outcome.step)
    if launch.world_size > 1:
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
