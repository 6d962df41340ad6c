"""Not tests: the hooks and helpers that the tracking tests share.

The hooks are loaded into a `kforge train` subprocess by import path
(``--train.hooks=["tests.e2e.test_tracking_hooks:SigtermAt"]``) and act only when their
environment variable is set, so the requeued job runs with exactly the same
``train.hooks`` (and so the same config) as the job that was stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

from kforge_cli.engine.train import TrainHook
from tests.conftest import REPO
from tests.helpers import tiny

HOOKS = "tests.e2e.test_tracking_hooks"

# A model small enough that a step takes milliseconds on a busy CPU.
TINY = [
    "--train.batch_size=2",
    "--train.seq_len=32",
    *tiny.model(64, 1, 2, 1),
    "--scheduler.warmup_steps=2",
    "--metrics.log_interval=1",
    "--metrics.progress_bar=off",
]


def hook_env(**extra: str) -> dict[str, str]:
    """Environment for a `kforge train` that imports these hooks (the repository on PYTHONPATH)."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def numeric_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The values of a metrics.jsonl record that trackers receive (numbers, not step/time)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class SigtermAt(TrainHook):
    """SIGTERMs this process after step ``$KFORGE_TEST_SIGTERM_AT``, as a preempting scheduler would."""

    def on_step_end(self, session: Any, info: Any) -> None:
        at = os.environ.get("KFORGE_TEST_SIGTERM_AT")
        if at and info.step == int(at):
            os.kill(os.getpid(), signal.SIGTERM)


class KillServerAt(TrainHook):
    """After step ``$KFORGE_TEST_KILL_AT``, SIGKILLs process group ``$KFORGE_TEST_KILL_PGID`` (a tracking
    server) and waits until its port ``$KFORGE_TEST_KILL_PORT`` refuses connections."""

    def on_step_end(self, session: Any, info: Any) -> None:
        at = os.environ.get("KFORGE_TEST_KILL_AT")
        if not at or info.step != int(at):
            return
        os.killpg(int(os.environ["KFORGE_TEST_KILL_PGID"]), signal.SIGKILL)
        port = int(os.environ["KFORGE_TEST_KILL_PORT"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                print(f"test hook: tracking server killed after step {info.step}", file=sys.stderr)
                return
            time.sleep(0.1)
        raise RuntimeError(f"the tracking server on port {port} still accepts connections after SIGKILL")
