"""Which step function a run uses: the one place step variants are registered.

Plain (one process, FSDP, TP), pipeline (`distributed.pp > 1`) and VLM (`[vlm]` set) all
share the step core in `engine.train.step`; later variants (MoE, CP) register here too.
"""

from __future__ import annotations

from kforge_cli.engine.train.pipeline_step import pipeline_step
from kforge_cli.engine.train.step import StepFn, plain_step
from kforge_cli.engine.train.vlm_step import VLMStep
from kforge_cli.settings import JobSettings


def select_step_fn(settings: JobSettings) -> StepFn:
    """The step function for this configuration (a fresh one per run: variants may keep state)."""
    if settings.distributed.pp > 1:
        return pipeline_step
    if settings.vlm is not None:
        return VLMStep()
    return plain_step
