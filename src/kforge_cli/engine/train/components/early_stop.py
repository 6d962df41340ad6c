"""Early stopping: end the run when the in-loop eval loss stops improving (``train.early_stop_patience``).

Written as a user would write a loop component: it hears every eval loss (``on_eval_end``),
keeps the best one and the count of evaluations since it improved by more than
``train.early_stop_min_delta``, and once that count reaches the patience it stops the run
(``after_update`` returns ``Stop``): the loop saves a checkpoint, the run exits 0 and
``metrics.jsonl`` gets an ``early_stop`` record. Its state is saved in every checkpoint under
its name, so a resumed run that already stopped says so and stops again, unless the patience
was raised (it continues) or set to 0 (the component is not built; its saved state is unused).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kforge_cli.common.json_values import dict_of, float_of, int_of
from kforge_cli.engine.train.components import LoopComponent, Stop, Verdict

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import StepInfo, TrainingSession

log = logging.getLogger("kforge")


class EarlyStop(LoopComponent):
    """Stops after ``patience`` evaluations without an improvement of more than ``min_delta``."""

    name = "early_stop"

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.best_step = 0
        self.stale = 0  # evaluations since the best one
        self.resumed_stopped = False

    def on_train_begin(self, session: TrainingSession) -> None:
        if not session.settings.eval.interval:
            log.warning("train.early_stop_patience needs in-loop evaluation (eval.interval > 0): it never stops")
        self.resumed_stopped = self.stale >= self.patience  # this run stopped early before: say so

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None:
        if self.best is None or eval_loss < self.best - self.min_delta:
            self.best, self.best_step, self.stale = eval_loss, step, 0
        else:
            self.stale += 1

    def after_update(self, session: TrainingSession, info: StepInfo) -> Verdict:
        return self._stop(session, info.step) if self.stale >= self.patience else None

    def before_step(self, session: TrainingSession, step: int) -> Verdict:  # a resumed run; or listed before the eval
        return self._stop(session, step) if self.stale >= self.patience else None

    def _stop(self, session: TrainingSession, step: int) -> Stop:
        reason = (
            f"the eval loss has not improved by more than {self.min_delta:g} for {self.stale} evaluations "
            f"(best {self.best:.4f} at step {self.best_step}; train.early_stop_patience = {self.patience})"
        )
        if self.resumed_stopped:
            log.warning(
                "this run stopped early at step %d: %s; to continue, raise train.early_stop_patience or set it to 0",
                step,
                reason,
            )
        session.metrics.write(
            {
                "step": step,
                "early_stop": 1,
                "early_stop/best_eval_loss": self.best,
                "early_stop/best_step": self.best_step,
                "early_stop/evals_without_improvement": self.stale,
                "early_stop/patience": self.patience,
            }
        )
        return Stop("early_stop", reason)

    def state_dict(self) -> object:
        return {"best": self.best, "best_step": self.best_step, "stale": self.stale}

    def load_state_dict(self, state: object) -> None:
        saved = dict_of(state, "early_stop")
        self.best = float_of(saved["best"]) if saved.get("best") is not None else None
        self.best_step, self.stale = int_of(saved.get("best_step", 0)), int_of(saved.get("stale", 0))
