"""engine.train.step: a step is an executor plus features (see `engine.train.step.core`).

`AccumulateStep` (gradient accumulation; one process, FSDP, TP, CP) and `ScheduleStep`
(the pipeline schedule) are the two executors; `StepFeature` is the base of what they are
composed with (engine.train.features). `build_step` in engine.train.features picks the
executor and features for a configuration.
"""

from kforge_cli.engine.train.step.accumulate import AccumulateStep
from kforge_cli.engine.train.step.core import Batch, StepFeature, StepFn, TokenNormaliser
from kforge_cli.engine.train.step.result import StepNumbers, StepResult
from kforge_cli.engine.train.step.schedule import ScheduleStep

plain_step = AccumulateStep()
"""The step of a run with no features (dense model, no pipeline)."""

__all__ = [
    "AccumulateStep",
    "Batch",
    "ScheduleStep",
    "StepFeature",
    "StepFn",
    "StepNumbers",
    "StepResult",
    "TokenNormaliser",
    "plain_step",
]
