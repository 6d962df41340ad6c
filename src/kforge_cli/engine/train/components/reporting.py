"""What a logging step's record gets from the run's shape: MFU, and the progress line or bar.

`Throughput` adds ``mfu`` (model FLOPs per token x tokens/s over the device's peak, see
`engine.observe.mfu`); `ProgressLine` shows the record on the terminal (rank 0) and each eval
loss. kforge lists `ProgressLine` last, so it shows what every other component added.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kforge_cli.engine.families.registry import family_for
from kforge_cli.engine.observe import ProgressReporter, device_peak_flops, mfu
from kforge_cli.engine.runtime import dtype_name
from kforge_cli.engine.train.components import LoopComponent

if TYPE_CHECKING:
    from kforge_cli.engine.train.session import TrainingSession

log = logging.getLogger("kforge")


class Throughput(LoopComponent):
    """``mfu`` in every step record (when the device's peak is known)."""

    def __init__(self) -> None:
        self.flops_per_token = 0.0
        self.peak_flops: float | None = None

    def on_train_begin(self, session: TrainingSession) -> None:
        s, device = session.settings, session.runtime.device
        self.flops_per_token = family_for(s.model).flops_per_token(s.model, s.train.seq_len)
        self.peak_flops = device_peak_flops(device, dtype_name(session.compute_dtype), s.metrics.peak_tflops)

    def on_log(self, session: TrainingSession, record: dict[str, object]) -> None:
        tps = record.get("tokens_per_sec")
        if not isinstance(tps, float | int):
            return
        util = mfu(self.flops_per_token, float(tps), session.runtime.world_size, self.peak_flops)
        if util is not None:
            record["mfu"] = util


class ProgressLine(LoopComponent):
    """``metrics.progress_bar``: a log line or a bar per logging step, on rank 0."""

    def __init__(self) -> None:
        self.progress: ProgressReporter | None = None

    def on_train_begin(self, session: TrainingSession) -> None:
        self.progress = ProgressReporter(
            total_steps=session.settings.train.max_steps,
            start_step=session.state.step,
            mode=session.settings.metrics.progress_bar,
            enabled=session.runtime.is_main,
            logger=log,
        )

    def on_log(self, session: TrainingSession, record: dict[str, object]) -> None:
        if self.progress is not None:
            self.progress.update(session.state.step, record)

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None:
        if self.progress is not None:
            self.progress.log_eval(step, eval_loss)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
