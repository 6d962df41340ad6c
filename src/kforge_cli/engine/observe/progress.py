"""Training progress for a human: a rich bar on a terminal, plain log lines elsewhere.

On a terminal a live bar shows where the run is, with the loss lines (one every
``metrics.log_interval`` steps) scrolling above it; in a SLURM log file or a CI job a bar's
control codes are noise, so there only the lines are written.
Only rank 0 reports (the others get a reporter whose methods do nothing). The ETA
uses the steps done by *this* process, because a resumed run would otherwise count
the time of steps it never ran.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

_MODES = ("auto", "on", "off")


def _format_eta(seconds: float | None) -> str | None:
    if seconds is None or not math.isfinite(seconds):
        return None
    return str(timedelta(seconds=round(max(seconds, 0.0))))


def _number(metrics: Mapping[str, object], key: str) -> float | int | None:
    value = metrics.get(key)
    return value if isinstance(value, float | int) else None


def format_metrics(metrics: Mapping[str, object], eta_s: float | None) -> str:
    """``loss 2.3456 | lr 3.0e-03 | grad_norm 0.812 | 12,345 tok/s | mfu 41.2% | eta 0:01:02``.

    Keys that are missing (or ``None``) are left out, so the same line serves steps
    with and without MFU.
    """
    parts: list[str] = []
    if (loss := _number(metrics, "loss")) is not None:
        parts.append(f"loss {loss:.4f}")
    if (lr := _number(metrics, "lr")) is not None:
        parts.append(f"lr {lr:.1e}")
    if (grad_norm := _number(metrics, "grad_norm")) is not None:
        parts.append(f"grad_norm {grad_norm:.3f}")
    if (tps := _number(metrics, "tokens_per_sec")) is not None:
        parts.append(f"{tps:,.0f} tok/s")
    if (util := _number(metrics, "mfu")) is not None:
        parts.append(f"mfu {100 * util:.1f}%")
    eta = _format_eta(eta_s)
    if eta is not None:
        parts.append(f"eta {eta}")
    return " | ".join(parts)


class ProgressReporter:
    """Reports step progress, metrics and an ETA (rank 0 only).

    ``clock`` is injectable so the ETA arithmetic can be tested without sleeping.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        mode: str,
        enabled: bool,
        logger: logging.Logger,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"progress mode must be one of {_MODES}, got {mode!r}")
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self._logger = logger
        self._clock = clock
        # ETA reference: process start until the second update, then the first update,
        # so a slow first step (compilation, warm-up) stops skewing the estimate.
        self._t_start = clock()
        self._first_update: tuple[int, float] | None = None
        self._progress: Progress | None = None
        self._task_id: TaskID | None = None
        use_bar = mode == "on" or (mode == "auto" and _stderr_is_tty())
        if enabled and use_bar:
            self._progress = Progress(
                TextColumn("step"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                # Log lines printed above the bar go through this console: soft_wrap leaves
                # wrapping to the terminal, so a run-dir path is never split by a newline.
                console=Console(stderr=True, soft_wrap=True),
                redirect_stderr=True,
            )
            self._task_id = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    @property
    def uses_bar(self) -> bool:
        """Whether a live rich bar is shown (else plain log lines)."""
        return self._progress is not None

    def eta_seconds(self, step: int) -> float | None:
        """Seconds left after ``step``, from the average step time in this process."""
        now = self._clock()
        if self._first_update is not None and step > self._first_update[0]:
            ref_step, ref_time = self._first_update
        else:
            ref_step, ref_time = self.start_step, self._t_start
        done = step - ref_step
        if done <= 0:
            return None
        return (now - ref_time) / done * max(self.total_steps - step, 0)

    def update(self, step: int, metrics: Mapping[str, object]) -> None:
        """Report that optimizer step ``step`` finished with these metrics."""
        if not self.enabled:
            return
        eta = self.eta_seconds(step)
        if self._first_update is None:
            self._first_update = (step, self._clock())
        info = format_metrics(metrics, eta)
        line = f"step {step}/{self.total_steps} | {info}" if info else f"step {step}/{self.total_steps}"
        if self._progress is not None and self._task_id is not None:
            self._progress.update(self._task_id, completed=step, info=info)
        # A permanent line every metrics.log_interval steps, also with the bar (printed above it):
        # the scrollback keeps the loss history, the bar shows where the run is now.
        self._logger.info(line)

    def log_eval(self, step: int, eval_loss: float) -> None:
        """Report an evaluation (always a log line, printed above the bar if there is one)."""
        if not self.enabled:
            return
        ppl = math.exp(eval_loss) if math.isfinite(eval_loss) and eval_loss < 700 else float("inf")
        self._logger.info(f"eval step {step}/{self.total_steps} | eval_loss {eval_loss:.4f} | ppl {ppl:.2f}")

    def close(self) -> None:
        """Stop the bar (leaving its last state on screen). Safe to call twice."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False
