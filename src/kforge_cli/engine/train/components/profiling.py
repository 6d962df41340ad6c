"""The profiler window (``profiling.*``) as a loop component."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kforge_cli.engine.observe import TrainProfiler, build_profiler
from kforge_cli.engine.train.components import LoopComponent

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import StepInfo, TrainingSession


class Profiling(LoopComponent):
    """Records the configured window of steps (built only when ``profiling.enabled``)."""

    def __init__(self) -> None:
        self.profiler: TrainProfiler | None = None

    def on_train_begin(self, session: TrainingSession) -> None:
        first = session.state.step + 1  # a resumed run: the window may have begun or passed
        self.profiler = build_profiler(
            session.settings.profiling,
            session.run_dir,
            session.runtime.rank,
            first_step=first,
            device=session.runtime.device,
        )

    def on_update(self, session: TrainingSession, info: StepInfo) -> None:
        if self.profiler is not None:
            self.profiler.step(info.step)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
