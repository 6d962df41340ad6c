"""TensorBoard backend: scalar event files under ``RUN_DIR/tensorboard``, one run across requeues.

Every job of a run writes into the same directory, so TensorBoard shows one run. A
requeued job redoes the steps after its checkpoint; its writer is opened at the first
step it logs with ``purge_step`` set to that step, which tells TensorBoard to drop the
earlier job's events from that step on, so each step is shown once (with the value of
the job that went on). The writer comes from ``torch.utils.tensorboard`` and needs the
``tensorboard`` package (``pip install 'kforge[tensorboard]'``), imported only when the
backend starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kforge_cli.common.files import real_dir
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.names import TENSORBOARD_DIR

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from kforge_cli.engine.observe.tracking_types import CheckpointMark, MetricPoints, RunInfo, TrackerStatus

LOG_SUBDIR = TENSORBOARD_DIR
PERF_KEYS = ("tokens_per_sec", "step_time_s", "mfu")


def tensorboard_tag(key: str) -> str:
    """A metrics.jsonl key as a grouped TensorBoard tag: ``loss`` -> ``train/loss``, ``eval_loss`` ->
    ``eval/loss``, ``tokens_per_sec`` -> ``perf/tokens_per_sec``, ``checkpoint_step`` -> ``checkpoint/step``.

    TensorBoard groups scalars by the text before the first '/'; keys that already have a group
    (``eval/heldout/loss``, ``checkpoint/bytes``) keep it, per-dataset ones join their metric's
    (``loss/web`` -> ``train/loss/web``).
    """
    head, sep, rest = key.partition("/")
    if head == "eval_loss":
        return f"eval/loss{sep}{rest}"
    if key == "checkpoint_step":
        return "checkpoint/step"
    if sep and head in ("eval", "checkpoint", "train", "perf", "memory"):
        return key
    if key in PERF_KEYS:
        return f"perf/{key}"
    if head.startswith("peak_"):
        return f"memory/{key}"
    return f"train/{key}"


class TensorboardBackend:
    """Scalars per step; the "run id" is the event directory (constant for a run dir)."""

    name = "tensorboard"

    def __init__(self, info: RunInfo, run_id: str | None = None, *, purge: bool = True) -> None:
        self.info = info
        self.purge = purge  # False: only add points (kforge eval logging at an old step must not purge)
        self.logdir = info.run_dir / LOG_SUBDIR
        self.run_id: str | None = run_id or LOG_SUBDIR
        self._writer: SummaryWriter | None = None
        self._writer_cls: type[SummaryWriter] | None = None

    def start(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InvalidInputError(
                "metrics.backends includes 'tensorboard' but the tensorboard package is not installed: "
                "pip install 'kforge[tensorboard]'"
            ) from None
        if self.logdir.is_symlink():
            raise InvalidInputError(f"{self.logdir} is a symlink; kforge does not write through links in a run dir")
        self._writer_cls = SummaryWriter

    def _open(self, first_step: int) -> SummaryWriter:
        if self._writer is None:
            assert self._writer_cls is not None, "start() first"
            real_dir(self.logdir)  # a link planted since start() is refused too
            purge_step = first_step if self.purge else None
            self._writer = self._writer_cls(log_dir=str(self.logdir), purge_step=purge_step, flush_secs=30)
        return self._writer

    def log_metrics(self, batch: Sequence[MetricPoints]) -> None:
        if not batch:
            return
        writer = self._open(min(p.step for p in batch))
        for points in batch:
            for key, value in points.values.items():
                writer.add_scalar(tensorboard_tag(key), value, global_step=points.step, walltime=points.time)
        writer.flush()

    def log_checkpoint(self, mark: CheckpointMark) -> None:
        writer = self._open(mark.step)
        writer.add_scalar(
            tensorboard_tag("checkpoint_step"), float(mark.step), global_step=mark.step, walltime=mark.time
        )

    def detach(self) -> None:
        """Close the event file without saying anything about the run (``kforge eval --track``)."""
        self.finish("completed")

    def finish(self, status: TrackerStatus) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
