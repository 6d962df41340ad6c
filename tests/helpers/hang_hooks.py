"""Training hooks that stall or slow one rank, for the hang watchdog and straggler tests.

`HangOnce`: on rank $KFORGE_TEST_HANG_RANK (default 1) the model's forward of optimizer step
$KFORGE_TEST_HANG_STEP sleeps $KFORGE_TEST_HANG_SLEEP seconds (default 600): a real hang of one
rank inside a step while the others wait in a collective. It fires once: the file
$KFORGE_TEST_HANG_MARKER is written first and, when it exists, nothing sleeps (so the same
command resumes and finishes).

`SlowRank`: rank $KFORGE_TEST_SLOW_RANK sleeps $KFORGE_TEST_SLOW_S seconds (default 0.02) after
every optimizer update (inside the update, where the straggler report measures local work).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kforge_cli.engine.train import TrainHook


class HangOnce(TrainHook):
    def on_train_begin(self, session: Any) -> None:
        step = int(os.environ.get("KFORGE_TEST_HANG_STEP", "0"))
        if not step or session.runtime.rank != int(os.environ.get("KFORGE_TEST_HANG_RANK", "1")):
            return
        marker = Path(os.environ["KFORGE_TEST_HANG_MARKER"])
        seconds = float(os.environ.get("KFORGE_TEST_HANG_SLEEP", "600"))

        def stall(module: Any, args: Any) -> None:
            if session.state.step + 1 == step and module.training and not marker.exists():
                marker.write_text(str(step))
                time.sleep(seconds)

        session.model.register_forward_pre_hook(stall)


class SlowRank(TrainHook):
    def on_train_begin(self, session: Any) -> None:
        if session.runtime.rank != int(os.environ.get("KFORGE_TEST_SLOW_RANK", "1")):
            return
        seconds = float(os.environ.get("KFORGE_TEST_SLOW_S", "0.02"))
        session.optimizer.register_step_post_hook(lambda *_: time.sleep(seconds))
