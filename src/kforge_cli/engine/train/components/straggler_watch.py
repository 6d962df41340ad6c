"""The straggler report as a loop component: it clocks each rank's own work and reports on logging steps.

With ``resilience.exclude_stragglers`` a persistent straggler on a SLURM node is recorded in
``RUN_DIR/logs/stragglers.jsonl`` (rank 0) and the run stops with a checkpoint (exit 75), so the
job script requeues the job without that node (``kforge_cli.slurm.exclude``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import torch

from kforge_cli.common.files import open_append, real_dir
from kforge_cli.engine.resilience import StragglerMonitor, local_parameter_count
from kforge_cli.engine.train.components import LoopComponent

log = logging.getLogger("kforge")
STRAGGLER_RECORDS = ("logs", "stragglers.jsonl")  # read by kforge_cli.slurm.exclude

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import StepInfo, TrainingSession


class StragglerReport(LoopComponent):
    """``resilience.straggler_ratio`` (more than one process; see `engine.resilience.straggler`)."""

    def __init__(self) -> None:
        self.monitor: StragglerMonitor | None = None
        self.token: float | torch.cuda.Event | None = None
        self.stopping = False

    def on_train_begin(self, session: TrainingSession) -> None:
        r, runtime = session.settings.resilience, session.runtime
        self.monitor = StragglerMonitor(
            rank=runtime.rank,
            world_size=runtime.world_size,
            device=runtime.device,
            ratio=r.straggler_ratio,
            windows=r.straggler_windows,
            local_params=local_parameter_count(session.model),
            exclude_ratio=r.exclude_straggler_ratio,
            exclude_windows=r.exclude_straggler_windows if r.exclude_stragglers else 0,
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
            if self.monitor.exclusion is not None and not self.stopping:
                self._stop_for(session, self.monitor.exclusion)

    def _stop_for(self, session: TrainingSession, exclusion: dict[str, object]) -> None:
        """Record the straggler (rank 0) and ask every rank to stop with a checkpoint (each decides the same)."""
        self.stopping = True
        if session.runtime.rank == 0:
            log.warning(
                "straggler: rank %s on SLURM node %s stayed above resilience.exclude_straggler_ratio = %s for %s "
                "logging intervals; stopping with a checkpoint so the job requeues without that node",
                exclusion["rank"],
                exclusion["node"],
                exclusion["threshold"],
                exclusion["windows"],
            )
            logs = real_dir(session.run_dir / STRAGGLER_RECORDS[0])
            with open_append(logs / STRAGGLER_RECORDS[1]) as f:
                f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **exclusion}) + "\n")
        if session.shutdown.signal_name is None:
            session.shutdown.signal_name = f"the straggler exclusion (node {exclusion['node']})"

    def on_rewind(self, session: TrainingSession) -> None:
        if self.monitor is not None:
            self.monitor.reset()
