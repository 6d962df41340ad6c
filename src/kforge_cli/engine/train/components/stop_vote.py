"""The stop vote: every ``resilience.stop_check_interval`` steps the ranks agree whether a signal asks to stop."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kforge_cli.engine.resilience import StopVote
from kforge_cli.engine.train.components import LoopComponent, Stop, Verdict

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")


class StopOnSignal(LoopComponent):
    """Stops the run (a checkpoint first) when any rank received one of ``resilience.shutdown_signals``."""

    def __init__(self) -> None:
        self.vote: StopVote | None = None

    def on_train_begin(self, session: TrainingSession) -> None:
        interval = session.settings.resilience.stop_check_interval  # a collective: every rank, same point
        self.vote = StopVote(session.shutdown, interval, distributed=session.runtime.world_size > 1)

    def before_step(self, session: TrainingSession, step: int) -> Verdict:
        if self.vote is None or not self.vote.should_stop(step):
            return None
        log.warning("stopping at step %d (%s)", step, session.shutdown.signal_name)
        return Stop("stopped", "a shutdown signal", signal=session.shutdown.signal_name)
