"""A training hook that injects NaN into the model output at chosen steps.

Steps come from the env var KFORGE_TEST_NAN_STEPS (comma-separated optimizer step
numbers), so the same hook works by import path from a `kforge train` subprocess.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kforge_cli.engine.train import TrainHook


class InjectNaN(TrainHook):
    def __init__(self, steps: set[int] | None = None) -> None:
        env = os.environ.get("KFORGE_TEST_NAN_STEPS", "")
        self.steps = steps if steps is not None else {int(s) for s in env.split(",") if s}
        self.losses: dict[int, float] = {}
        self.lrs: dict[int, float] = {}
        self.skipped: list[int] = []
        self.params_before: dict[int, torch.Tensor] = {}

    def on_train_begin(self, session: Any) -> None:
        def poison(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            if session.state.step + 1 in self.steps and module.training:
                return output * float("nan")
            return output

        session.model.register_forward_hook(poison)

    def on_step_end(self, session: Any, info: Any) -> None:
        self.losses[info.step] = info.loss
        self.lrs[info.step] = info.lr
        if info.skipped:
            self.skipped.append(info.step)
        self.params_before[info.step] = session.model.norm.weight.detach().clone()
