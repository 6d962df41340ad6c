"""An evaluation per checkpoint (``eval.after_checkpoint``): the loop's side, on rank 0 only.

The mechanism lives in `engine.evaluation.after_checkpoint` (`CheckpointEvaluations`); this
component is what the loop calls:

- ``on_save``: a checkpoint was saved (an async one may still be writing): pin it;
- ``after_update``: start the evaluations of the checkpoints committed since (the commit marker
  is there), notice the ones that ended (a failed or killed one: a warning and its status);
- ``on_log``: hand finished results to the tracker once: metrics.jsonl at the checkpoint's step,
  W&B at the current step with ``eval/checkpoint_step`` (W&B takes no older step; MLflow and
  TensorBoard got theirs from the evaluation itself), and the loop's time spent here so far
  (``eval_after_checkpoint/blocked_s``);
- ``on_train_end``: start the last checkpoint's evaluation and return: training's end does not
  wait for evaluations still running (their results land in eval/step_N.json and the status files,
  which `kforge runs` counts).

Every call is timed (`blocked_s`): a file test, a ``waitpid`` and a fork per checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.engine.evaluation.after_checkpoint import CheckpointEvaluations, flat_record
from kforge_cli.engine.train.components import LoopComponent, Verdict
from kforge_cli.rundir.names import CHECKPOINTS_DIR

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import StepInfo, TrainingSession

log = logging.getLogger("kforge")
BLOCKED_KEY = "eval_after_checkpoint/blocked_s"


class EvalAfterCheckpoint(LoopComponent):
    """Starts `kforge eval` of every committed checkpoint in a process of its own (rank 0)."""

    def __init__(self) -> None:
        self.evals: CheckpointEvaluations | None = None  # rank 0, from on_train_begin

    def on_train_begin(self, session: TrainingSession) -> None:
        if session.runtime.is_main:
            self.evals = CheckpointEvaluations(session.settings, Path(session.run_dir))
            if Path(session.checkpointer.root).resolve() != (Path(session.run_dir) / CHECKPOINTS_DIR).resolve():
                log.warning(
                    "eval.after_checkpoint: checkpoints live in %s, outside the run directory: their "
                    "evaluations cannot find the run's data and settings and will fail",
                    session.checkpointer.root,
                )

    def _timed(self, what: str, act: Callable[[], object]) -> None:
        """Run ``act``, timed into ``blocked_s``; a failure is a warning, never the run's end."""
        assert self.evals is not None
        t0 = time.perf_counter()
        try:
            act()
        except Exception as exc:  # an evaluation is never fatal to training
            log.warning("eval.after_checkpoint: %s failed (%s: %s); training continues", what, type(exc).__name__, exc)
        finally:
            self.evals.blocked_s += time.perf_counter() - t0

    def on_save(self, session: TrainingSession, step: int, path: str) -> None:
        if self.evals is not None:
            evals = self.evals
            self._timed(f"pinning {path}", lambda: evals.saved(step, Path(path)))

    def after_update(self, session: TrainingSession, info: StepInfo) -> Verdict:
        if self.evals is not None and self.evals.evaluations:
            evals = self.evals
            self._timed("starting or checking an evaluation", lambda: (evals.start_committed(), evals.check()))
        return None

    def on_log(self, session: TrainingSession, record: dict[str, object]) -> None:
        if self.evals is None:
            return
        step = int(str(record.get("step", session.step)))
        self._timed("relaying results", lambda: self._relay(session, step))
        record[BLOCKED_KEY] = self.evals.blocked_s

    def _relay(self, session: TrainingSession, step: int) -> None:
        assert self.evals is not None
        wandb = "wandb" in session.settings.metrics.backends
        for ckpt_step, results in self.evals.finished_results():
            values = flat_record(results)
            session.metrics.write({"step": ckpt_step, **values}, only=("jsonl",))
            if wandb:  # W&B takes no step below its current one
                session.metrics.write({"step": step, **values, "eval/checkpoint_step": ckpt_step}, only=("wandb",))

    def on_train_end(self, session: TrainingSession, status: str) -> None:
        if self.evals is None:
            return
        evals = self.evals
        self._timed(  # the last save is committed by now
            "starting the last evaluation",
            lambda: (evals.start_committed(), evals.check(), self._relay(session, session.step)),
        )
        t0 = time.perf_counter()
        evals.drain()  # the last fork (milliseconds), never an evaluation's end
        forking_s = time.perf_counter() - t0
        counts = evals.counts()
        started = counts["running"] + counts["done"] + counts["failed"]
        try:
            session.metrics.write({"step": session.step, BLOCKED_KEY: evals.blocked_s}, only=("jsonl",))
        except Exception as exc:  # a failed run may have closed its tracker already
            log.debug("eval.after_checkpoint: no last metrics record (%s)", exc)
        log.info(
            "eval.after_checkpoint: %d evaluation(s) started (%d still running, %d failed); the loop held "
            "%.1f ms for them in all, its end %.1f ms for the last start; training does not wait for them "
            "(kforge runs counts them)",
            started,
            counts["running"],
            counts["failed"],
            evals.blocked_s * 1e3,
            forking_s * 1e3,
        )
