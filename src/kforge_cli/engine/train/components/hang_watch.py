"""The hang watchdog as a loop component: it follows the loop's phases and exits 76 when one stalls.

The watchdog thread itself is `engine.resilience.HangWatchdog`; this adapter starts it when
training begins, marks each phase the loop announces (a step counts as done at the first
phase after it), and stops it at the end. On the failure path it lets a watchdog that fired
finish (a peer that exited on a hang breaks our collective: we exit as a hang too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kforge_cli.engine.resilience import HangWatchdog, hang_dir
from kforge_cli.engine.runtime import process_group_timeout_s
from kforge_cli.engine.train.components import LoopComponent

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession


class HangWatch(LoopComponent):
    """``resilience.hang_timeout_s`` (built only when it is not 0)."""

    def __init__(self) -> None:
        self.watchdog: HangWatchdog | None = None
        self.beaten = 0

    def on_train_begin(self, session: TrainingSession) -> None:
        ckpt = session.checkpointer

        def note() -> str:
            return f" (last saved: step {ckpt.last_step})" if ckpt.last_step is not None else " (none saved yet)"

        self.beaten = session.state.step
        self.watchdog = HangWatchdog(
            rank=session.runtime.rank,
            world_size=session.runtime.world_size,
            directory=hang_dir(session.run_dir),
            timeout_s=session.settings.resilience.hang_timeout_s,
            pg_timeout_s=process_group_timeout_s(session.settings),
            resume_note=note,
        ).start()

    def phase(self, name: str, step: int) -> None:
        if self.watchdog is None:
            return
        if step > self.beaten:  # the first phase after a step: the step is done
            self.beaten = step
            self.watchdog.beat(step)
        self.watchdog.mark(name)

    def on_rewind(self, session: TrainingSession) -> None:
        self.beaten = session.state.step
        if self.watchdog is not None:
            self.watchdog.restart_timing()

    def on_train_end(self, session: TrainingSession, status: str) -> None:
        if status == "failed" and self.watchdog is not None:
            self.watchdog.wait_if_fired()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
