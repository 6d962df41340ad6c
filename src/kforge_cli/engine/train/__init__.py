"""engine.train (layer 5): loss, optimizers (optim/), the step (step/ executors and features/),
hooks, the loop, and the recipe that assembles a run."""

from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.train.features import build_step, features_for
from kforge_cli.engine.train.hooks import StepInfo, TrainHook
from kforge_cli.engine.train.loop import TrainOutcome, run_training_loop
from kforge_cli.engine.train.recipe import Recipe, assemble, run_training
from kforge_cli.engine.train.session import TrainingSession
from kforge_cli.engine.train.step import StepFeature, StepResult, plain_step

__all__ = [
    "Recipe",
    "StepFeature",
    "StepInfo",
    "StepResult",
    "TrainHook",
    "TrainOutcome",
    "TrainState",
    "TrainingSession",
    "assemble",
    "build_step",
    "features_for",
    "plain_step",
    "run_training",
    "run_training_loop",
]
