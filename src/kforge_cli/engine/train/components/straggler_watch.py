"""The straggler report as a loop component: it clocks each rank's own work and reports on logging steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kforge_cli.engine.resilience import StragglerMonitor, local_parameter_count
from kforge_cli.engine.train.components import LoopComponent

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import StepInfo, TrainingSession


class StragglerReport(LoopComponent):
    """``resilience.straggler_ratio`` (more than one process; see `engine.resilience.straggler`)."""

    def __init__(self) -> None:
        self.monitor: StragglerMonitor | None = None
        self.token: float | torch.cuda.Event | None = None

    def on_train_begin(self, session: TrainingSession) -> None:
        r, runtime = session.settings.resilience, session.runtime
        self.monitor = StragglerMonitor(
            rank=runtime.rank,
            world_size=runtime.world_size,
            device=runtime.device,
            ratio=r.straggler_ratio,
            windows=r.straggler_windows,
            local_params=local_parameter_count(session.model),
        )

    def before_update(self, session: TrainingSession) -> None:
        if self.monitor is not None:
            self.token = self.monitor.begin_update()

    def on_update(self, session: TrainingSession, info: StepInfo) -> None:
        if self.monitor is not None and self.token is not None:
            self.monitor.end_update(self.token, info.data_time_s)

    def on_log(self, session: TrainingSession, record: dict[str, object]) -> None:
        if self.monitor is not None:
            record.update(self.monitor.report(session.state.step))  # one all-gather, every rank

    def on_rewind(self, session: TrainingSession) -> None:
        if self.monitor is not None:
            self.monitor.reset()
