"""A training hook that makes every step slow and announces it, for signal tests.

`kforge train --train.hooks='["tests.helpers.slow_hooks:SlowSteps"]'` writes the step
number to $KFORGE_TEST_STEP_FILE after each step and sleeps $KFORGE_TEST_STEP_SLEEP
seconds (default 0.3), so a test knows when training runs and has time to signal it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kforge_cli.engine.train import TrainHook


class SlowSteps(TrainHook):
    def on_step_end(self, session: Any, info: Any) -> None:
        marker = os.environ.get("KFORGE_TEST_STEP_FILE")
        if marker:
            Path(f"{marker}.{session.runtime.rank}").write_text(str(info.step))
        time.sleep(float(os.environ.get("KFORGE_TEST_STEP_SLEEP", "0.3")))
