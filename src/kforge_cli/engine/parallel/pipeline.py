"""Pipeline parallelism with ``torch.distributed.pipelining``: stages and schedules.

The blocks are split into ``pp * pp_stages_per_rank`` consecutive stages (layers that
do not divide evenly go to the earliest stages, which also carry the embedding); the
last stage carries the final norm and the head (the family's ``plan.first_stage`` and
``plan.last_stage`` modules). A stage is the family's model itself with the blocks it does not own deleted, so its parameter names stay those of the full
model (``layers.<global index>...``), which keeps checkpoints independent of the
pipeline layout.

Stage ``s`` lives on pipeline rank ``s % pp`` for looped schedules (interleaved 1F1B
and zero bubble) and on rank ``s`` or ``2*pp-1-s`` for the V-shaped ones (ZBV,
DualPipeV), whose rank 0 holds both the first and the last stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kforge_cli.engine.families.base import BLOCKS
from kforge_cli.engine.families.registry import family_for, family_of
from kforge_cli.engine.parallel.cost_terms import Traffic
from kforge_cli.settings import JobSettings
from kforge_cli.settings.pipeline_schedules import schedule_facts
from kforge_cli.settings.training import ModelSettings

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import PipelineStage


def stage_layer_ids(n_layers: int, n_stages: int) -> list[list[int]]:
    """Block indices of each stage: consecutive, sizes differing by at most one, larger first."""
    if not 0 < n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} blocks into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_ids_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The global stage indices pipeline rank ``pp_rank`` runs, in increasing order."""
    if schedule_facts(schedule).v_shaped:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def stage_owner(stage_id: int, pp_size: int, schedule: str) -> int:
    """The pipeline rank that runs stage ``stage_id``."""
    if schedule_facts(schedule).v_shaped:
        return stage_id if stage_id < pp_size else 2 * pp_size - 1 - stage_id
    return stage_id % pp_size


def build_stage_module(cfg: ModelSettings, layer_ids: list[int], *, first: bool, last: bool) -> nn.Module:
    """The model of ``cfg``'s family on the meta device holding only ``layer_ids`` (+ the family's
    first-stage modules if ``first``, its last-stage ones if ``last``): ``ModelFamily.build_stage``."""
    return family_for(cfg).build_stage(cfg, layer_ids, first=first, last=last)


class PipelineModel(nn.Module):
    """This rank's stages seen as one module (for the optimizer, clipping and checkpoints).

    It shares the stages' submodules, so its parameter names are the full model's (the blocks
    ``layers.<i>``, and the family's first- and last-stage root modules) whatever the layout. It
    cannot be called: the pipeline schedule runs the stages.
    """

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stage_modules = stages  # plain list: not registered, so no "stage_modules." prefix
        setattr(self, BLOCKS, nn.ModuleDict())
        blocks = self.get_submodule(BLOCKS)
        plan = family_of(stages[0]).plan
        roots = plan.first_stage + plan.last_stage
        for name in roots:
            setattr(self, name, None)
        for stage in stages:
            for key, block in stage.get_submodule(BLOCKS).named_children():
                blocks.add_module(key, block)
            for name in roots:
                if getattr(stage, name, None) is not None:
                    setattr(self, name, getattr(stage, name))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline-parallel model runs through its schedule (engine.train.step.schedule)")


class StageLoss:
    """The schedule's loss function: ``loss_sum(output, target) * scale``.

    The schedule is built once with this object. The loss-sum rule is bound once when the
    training session is assembled (`bind`); only ``scale`` changes per step (the step's
    token normaliser: ``dp_size / global valid tokens`` when training, 1 for evaluation),
    written in place so nothing about the schedule is swapped between steps.
    """

    def __init__(self) -> None:
        self.loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.scale: torch.Tensor | float = 1.0

    def bind(self, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_sum = loss_sum

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_sum is None:
            raise RuntimeError("the pipeline loss is bound when the training session is built (engine.train)")
        return self.loss_sum(output, target) * self.scale


@dataclass
class PipelineBundle:
    """This rank's pipeline stages, their modules and the schedule that runs them."""

    stages: list[PipelineStage]  # in increasing stage index
    modules: list[nn.Module]  # the stage modules, same order
    stage_ids: list[int]
    num_stages: int
    schedule: Any  # a torch schedule; engine/train/step passes it the stages' keyword inputs
    loss: StageLoss = field(default_factory=StageLoss)

    @property
    def is_first(self) -> bool:
        """This rank runs stage 0 (and feeds it the token ids)."""
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage (and computes the loss)."""
        return self.num_stages - 1 in self.stage_ids


def training_step_infers_metadata(schedule: object) -> bool:
    """Whether the schedule's next training ``step`` first runs its metadata inference.

    torch's schedules infer the stages' activation shapes with one extra forward (and an
    input-gradient backward) per stage before the real micro-batches, at the first step and
    again after each switch between ``eval`` and ``step``. That forward runs on stand-in
    activations, so state a module keeps across forwards (the MoE layers' token counts) must
    skip it. The flags read here are private to torch; a version without them is refused
    rather than guessed at.
    """
    for prefix in ("_stages", "_stage"):  # multi-stage, single-stage schedules
        fwd = getattr(schedule, f"{prefix}_forward_initialized", None)
        bwd = getattr(schedule, f"{prefix}_backward_initialized", None)
        if fwd is not None and bwd is not None:
            return not (fwd and bwd)
    raise RuntimeError(
        f"{type(schedule).__name__} of torch {torch.__version__} does not say when it infers stage shapes; "
        "Mixture-of-Experts under pipeline parallelism needs a torch whose schedules do (torch 2.13's do)"
    )


def _schedule_class(name: str) -> type:
    from torch.distributed.pipelining import schedules

    return getattr(schedules, schedule_facts(name).torch_class)


def build_pipeline(
    settings: JobSettings,
    stage_modules: list[nn.Module],
    stage_ids: list[int],
    device: torch.device,
    group: ProcessGroup | None,
) -> PipelineBundle:
    """Wrap the (parallelised, initialised) stage modules in PipelineStages and build the schedule."""
    from torch.distributed.pipelining import PipelineStage

    d = settings.distributed
    n_stages = d.pp * d.pp_stages_per_rank
    stages = [
        PipelineStage(module, stage_index=sid, num_stages=n_stages, device=device, group=group)
        for module, sid in zip(stage_modules, stage_ids, strict=True)
    ]
    loss = StageLoss()
    cls, multi = _schedule_class(d.pp_schedule), schedule_facts(d.pp_schedule).multi_stage
    # Losses are sums normalised by the step's token count: gradients must not be scaled again.
    schedule = cls(
        stages if multi else stages[0], n_microbatches=settings.train.grad_accum_steps, loss_fn=loss, scale_grads=False
    )
    return PipelineBundle(
        stages=stages,
        modules=stage_modules,
        stage_ids=stage_ids,
        num_stages=n_stages,
        schedule=schedule,
        loss=loss,
    )


# Cost terms (pure, for the planner: engine.parallel.cost_terms).


def bubble_share(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The idle share of a pipeline step: ``(pp-1) / (v m + pp-1)`` for GPipe, 1F1B and interleaved 1F1B
    (``v`` stages per rank, ``m`` micro-batches); zero-bubble schedules split the backward and fill
    about two thirds of that, ``(pp-1) / (3 v m + pp-1)`` (Qi et al. 2023, ZB-H1)."""
    if pp == 1:
        return 0.0
    v, m = stages_per_rank, microbatches
    fill = 3 if schedule_facts(schedule).zero_bubble else 1
    return (pp - 1) / (fill * v * m + pp - 1)


def comm_terms(*, pp: int, stride: int, n_stages: int, micro_batches: int, activation_bytes: int) -> list[Traffic]:
    """PP's traffic of one rank per step: one activation forward and one gradient backward per
    micro-batch and stage it holds, to the neighbouring pipeline rank (``stride`` ranks away)."""
    if pp <= 1:
        return []
    return [Traffic("pp", 2 * micro_batches * n_stages * activation_bytes, 2, stride)]


def buffer_bytes(*, pp: int, n_stages: int, activation_bytes: int) -> int:
    """Send/receive buffers of activations and gradients, per stage this rank holds."""
    return 2 * activation_bytes * n_stages if pp > 1 else 0
