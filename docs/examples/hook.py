"""A training hook: RUN_DIR/best_eval.json keeps the lowest evaluation loss so far and its step.

Register it from the settings (`train.hooks = ["my_pkg.hooks:BestEvalLoss"]`, imported by path)
or from Python (`run_training(settings, hooks=[BestEvalLoss()])`).
"""

from __future__ import annotations

import json
from typing import Any

from kforge_cli.engine.train import TrainHook


class BestEvalLoss(TrainHook):
    FILE = "best_eval.json"

    def __init__(self) -> None:
        self.best: float | None = None

    def on_train_begin(self, session: Any) -> None:
        path = session.run_dir / self.FILE
        if path.is_file():  # a resumed run continues from the best it had
            self.best = float(json.loads(path.read_text())["eval_loss"])

    def on_eval_end(self, session: Any, step: int, eval_loss: float) -> None:
        if self.best is not None and eval_loss >= self.best:
            return
        self.best = eval_loss
        session.metrics.write({"step": step, "eval/best_loss": eval_loss})  # rank 0 writes; others: no-op
        if session.runtime.is_main:
            (session.run_dir / self.FILE).write_text(json.dumps({"step": step, "eval_loss": eval_loss}))
