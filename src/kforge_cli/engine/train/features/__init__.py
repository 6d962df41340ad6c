"""engine.train.features: the step features kforge ships, and the one place a step is composed.

`features_for(settings)` lists the features a configuration needs (fresh objects: features
may keep state across steps); `build_step` puts them into the executor the configuration
runs (the pipeline schedule under ``distributed.pp > 1``, else accumulation). Which
combinations are allowed is decided only by the settings rules (kforge_cli.settings.rules);
nothing here depends on the order of an ``if``-chain.
"""

from __future__ import annotations

from collections.abc import Sequence

from kforge_cli.engine.train.features.moe_aux import MoEFeature
from kforge_cli.engine.train.features.mtp import MTPFeature
from kforge_cli.engine.train.features.vlm_freeze import FreezeFeature, init_optimizer_state
from kforge_cli.engine.train.step import AccumulateStep, ScheduleStep, StepFeature, StepFn
from kforge_cli.settings import JobSettings


def features_for(settings: JobSettings) -> list[StepFeature]:
    """The step features of this configuration, in the order their hooks run."""
    features: list[StepFeature] = []
    if settings.model.moe is not None:
        features.append(MoEFeature())
    if settings.model.mtp_depth:
        features.append(MTPFeature(settings.model.mtp_depth, settings.model.mtp_loss_weight))
    if settings.vlm is not None:
        features.append(FreezeFeature())
    return features


def build_step(settings: JobSettings, features: Sequence[StepFeature]) -> StepFn:
    """The executor this configuration runs, composed with ``features``."""
    if settings.distributed.pp > 1:
        return ScheduleStep(features)
    return AccumulateStep(features)


__all__ = ["FreezeFeature", "MTPFeature", "MoEFeature", "build_step", "features_for", "init_optimizer_state"]
