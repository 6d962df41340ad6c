"""Graceful shutdown: a signal (SIGTERM from the cluster, SIGUSR1 before the time limit)
stops training at the next step boundary instead of killing it mid-step.

The handler only sets a flag. `StopVote` all-reduces the flag (MAX) at every
``resilience.stop_check_interval``-th step boundary, so that a signal delivered to only some
ranks still stops every rank at the same step; the vote runs over a gloo group of its own
on a host tensor, so it never waits on (or stalls) a GPU stream. One process checks its
flag at every step boundary (nothing to agree on, nothing to wait for).
SIGINT (Ctrl-C) is one of the default signals, so a first Ctrl-C saves and stops like a
cluster's SIGTERM; a second Ctrl-C raises KeyboardInterrupt at once (exit 130) for a user
who does not want to wait for the save, or, once the checkpoint of the step it stopped at is
complete (`saved_step`), :class:`~kforge_cli.errors.SavedInterrupt` (exit 75: nothing is lost). A repeated SIGTERM stays a no-op (launchers send one
again while a rank tears down).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

from kforge_cli.errors import InvalidInputError, SavedInterrupt

log = logging.getLogger("kforge")


class ShutdownHandler:
    """Installs handlers for `signals`; restore the previous ones with `close()`."""

    def __init__(self, signals: list[str]) -> None:
        self.signal_name: str | None = None
        self.saved_step: int | None = None  # set once the stop's checkpoint is complete (engine.train.loop)
        self._previous: dict[int, signal._HANDLER] = {}  # pyright: ignore[reportPrivateUsage]
        self._installed = False
        self._signals = [self._lookup(name) for name in signals]

    @staticmethod
    def _lookup(name: str) -> signal.Signals:
        key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        try:
            return signal.Signals[key]
        except KeyError:
            raise InvalidInputError(f"resilience.shutdown_signals: unknown signal {name!r}") from None

    def install(self) -> ShutdownHandler:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: shutdown signals are not handled")
            return self
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._installed = True
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            again = " (Ctrl-C again to stop at once, without saving)" if signum == signal.SIGINT else ""
            log.warning(
                "received %s: stopping at the next step boundary and saving a checkpoint%s", self.signal_name, again
            )
        elif signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if self.saved_step is not None:
                raise SavedInterrupt(self.saved_step)
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        """This rank received a signal."""
        return self.signal_name is not None

    def should_stop(self, all_reduce_max: Callable[[bool], bool] | None = None) -> bool:
        """True when any rank received a signal (collective when `all_reduce_max` is given)."""
        flag = self.requested
        if all_reduce_max is not None:
            flag = all_reduce_max(flag)
            if flag and self.signal_name is None:
                self.signal_name = "peer signal"
        return flag

    def close(self) -> None:
        """Restore the previous handlers, unless this process is stopping on a signal.

        A process that stops on a signal keeps the flag-only handlers until it exits: the
        launcher's follow-up SIGTERM (srun --kill-on-bad-exit ends the step as soon as one
        rank exits with 75) must not kill a rank still in its teardown and turn the agreed
        exit code 75 (requeue) into 143.
        """
        if self._installed and self.signal_name is None:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._installed = False

    def __enter__(self) -> ShutdownHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()


class StopVote:
    """All ranks agree, every ``interval`` steps, whether any of them received a stop signal.

    The vote is a MAX all-reduce of a CPU tensor over a dedicated gloo group (created here,
    a collective: every rank constructs its vote at the same point), so a GPU run neither
    syncs its stream nor mixes the vote into the training communicator. The checked steps
    are multiples of ``interval``, the same on every rank, so all stop at the same step.
    """

    def __init__(self, handler: ShutdownHandler, interval: int, *, distributed: bool) -> None:
        self.handler, self.interval = handler, interval
        self.group = dist.new_group(backend="gloo") if distributed else None

    def should_stop(self, step: int) -> bool:
        """At a step boundary (``step`` optimizer steps done): stop now?"""
        if self.group is None:
            return self.handler.should_stop()
        if step % self.interval:
            return False
        group = self.group

        def any_rank(flag: bool) -> bool:
            t = torch.tensor([1 if flag else 0], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            return bool(t[0] > 0)

        return self.handler.should_stop(any_rank)
