"""In-loop evaluation as a loop component: the eval loss and the ``eval.tasks`` every ``eval.interval`` steps.

The evaluations themselves are `engine.evaluation.in_loop.evaluate` (held-out loss) and
`engine.evaluation.downstream.downstream_eval` (multiple choice); this component runs them on
schedule, writes their records, and tells every component the eval loss (``on_eval_end``).
A run whose last step is not a multiple of the interval is evaluated once more at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kforge_cli.engine.evaluation.downstream import downstream_eval
from kforge_cli.engine.evaluation.in_loop import evaluate
from kforge_cli.engine.train.components import LoopComponent, Stop, Verdict

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import StepInfo, TrainingSession


class InLoopEval(LoopComponent):
    """Built when ``eval.interval`` > 0."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def after_update(self, session: TrainingSession, info: StepInfo) -> Verdict:
        if info.step % self.interval == 0:
            session.components.phase("eval", info.step)
            self.run(session)
        return None

    def on_loop_end(self, session: TrainingSession, how: Stop) -> None:
        if how.status == "completed" and session.state.step % self.interval != 0:
            self.run(session)

    def run(self, session: TrainingSession) -> float | None:
        eval_loss = evaluate(session)
        step = session.state.step
        downstream = downstream_eval(session)  # eval.tasks (multiple choice), on every rank
        if downstream:
            session.metrics.write({"step": step, **downstream})
        if eval_loss is None:
            return None
        session.metrics.write({"step": step, "eval_loss": eval_loss})
        session.components.on_eval_end(session, step, eval_loss)
        return eval_loss
