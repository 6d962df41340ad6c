"""engine.train (layer 4): loss, optimizers, schedulers, hooks, step functions, the loop, the recipe."""

from kforge_cli.engine.train.hooks import StepInfo, TrainHook
from kforge_cli.engine.train.loop import TrainOutcome, run_training_loop
from kforge_cli.engine.train.recipe import run_training
from kforge_cli.engine.train.session import TrainingSession
from kforge_cli.engine.train.step import StepResult, plain_step
from kforge_cli.engine.train.steps import select_step_fn
from kforge_cli.engine.train.train_state import TrainState

__all__ = [
    "StepInfo",
    "StepResult",
    "TrainHook",
    "TrainOutcome",
    "TrainState",
    "TrainingSession",
    "plain_step",
    "run_training",
    "run_training_loop",
    "select_step_fn",
]
