"""Which step function a run uses: the one place step variants are registered.

Plain (one process, FSDP, TP), pipeline (`distributed.pp > 1`), VLM (`[vlm]` set), MoE
(`[model.moe]`, with or without a pipeline) and CP all share the step core in
`engine.train.step`; every variant registers here.
"""

from __future__ import annotations

from kforge_cli.engine.train.cp_step import ContextParallelStep
from kforge_cli.engine.train.moe_pipeline_step import MoEPipelineStep
from kforge_cli.engine.train.moe_step import MoEStep
from kforge_cli.engine.train.pipeline_step import pipeline_step
from kforge_cli.engine.train.step import StepFn, plain_step
from kforge_cli.engine.train.vlm_step import VLMStep
from kforge_cli.settings import JobSettings


def select_step_fn(settings: JobSettings) -> StepFn:
    """The step function for this configuration (a fresh one per run: variants may keep state)."""
    if settings.distributed.pp > 1:
        return MoEPipelineStep() if settings.model.moe is not None else pipeline_step
    if settings.vlm is not None:
        return VLMStep()
    if settings.model.moe is not None:
        return MoEStep()
    if settings.distributed.cp > 1:
        return ContextParallelStep()
    return plain_step
