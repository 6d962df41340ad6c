"""The recipe: a run's phases as data, and the one function that assembles a session from them.

A `Recipe` is a frozen record of builders, each defaulting to kforge's own:

============  ===============================================  ==============================
phase         called as                                        default
============  ===============================================  ==============================
model         (settings, runtime) -> (model, pipeline|None)    `build_parallel_model`
data          (settings, runtime) -> TrainData                 `build_train_data`
loss          (settings) -> LossFn                             `build_loss_fn`
optimizer     (model, settings, runtime) -> Optimizer          `build_train_optimizer`
scheduler     (optimizer, settings) -> LRScheduler             `build_train_scheduler`
checkpointer  (settings, runtime, run_dir, parts) -> manager   `build_checkpointer`
tracker       (settings, runtime, run_dir, run_ids) -> Tracker `build_run_tracker`
features      (settings) -> list[StepFeature]                  `features_for`
step          (settings, features) -> StepFn                   `build_step`
components    (settings, world_size) -> list[LoopComponent]    `components_for`
hooks         a tuple of `TrainHook` observers                 ()
============  ===============================================  ==============================

`assemble` builds the session from a recipe in this order: loss -> model -> optimizer ->
scheduler -> data -> components (the user's hooks first) and the update -> checkpointer
(holding every named part) -> restore -> tracker -> features and step -> session. `run_training` wraps it: runtime -> run directory and logs -> assemble
-> loop -> teardown. Tests assemble sessions the same way (tests/helpers/tiny_run.py), so
there is one recipe, not a copy.

An experiment swaps any phase with a keyword argument and keeps the rest::

    from kforge_cli.engine.train import run_training
    from kforge_cli.engine.train.optim import build_optimizer

    def sgd(model, settings, runtime):
        return torch.optim.SGD(model.parameters(), lr=settings.optimizer.lr, momentum=0.9)

    run_training(settings, optimizer=sgd, hooks=[MyHook()])

or builds a `Recipe` once (``Recipe().with_phases(optimizer=sgd)``) and passes it as ``recipe=``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kforge_cli.engine.checkpoint import CheckpointManager, RunParts
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.data import TrainData, build_data
from kforge_cli.engine.data.vlm import build_vlm_data
from kforge_cli.engine.evaluation.in_loop import eval_batches
from kforge_cli.engine.interop.hf_import import load_hf_weights
from kforge_cli.engine.interop.mot_convert import maybe_mot_warm_start
from kforge_cli.engine.observe import (
    Tracker,
    build_tracker,
    reset_peak_memory,
    setup_logging,
)
from kforge_cli.engine.parallel import (
    PipelineBundle,
    build_parallel_model,
    compute_dtype,
    fsdp_float8_all_gather,
    precompute_scales_after_each_step,
)
from kforge_cli.engine.plan.shrink_replan import replan_for_world
from kforge_cli.engine.resilience import ShutdownHandler, archive_previous, hang_dir
from kforge_cli.engine.resilience.hang_report import read_own_file
from kforge_cli.engine.runtime import RuntimeContext, detect_launch, init_runtime, teardown_runtime
from kforge_cli.engine.train.banner import announce_start, building_line
from kforge_cli.engine.train.components import Components, LoopComponent
from kforge_cli.engine.train.components.nan_policy import NanPolicy
from kforge_cli.engine.train.components.selection import components_for
from kforge_cli.engine.train.features import build_step, features_for
from kforge_cli.engine.train.hooks import StepInfo, build_hooks
from kforge_cli.engine.train.loop import TrainOutcome, run_training_loop
from kforge_cli.engine.train.loss import LossFn, build_loss_fn
from kforge_cli.engine.train.optim import build_optimizer, build_scheduler
from kforge_cli.engine.train.rewind import apply_recorded_skips
from kforge_cli.engine.train.run_dir import resolve_run_dir, write_config
from kforge_cli.engine.train.session import TrainHook, TrainingSession
from kforge_cli.engine.train.step import StepFeature, StepFn
from kforge_cli.engine.train.step.schedule import bind_pipeline_loss
from kforge_cli.engine.train.update import Update, build_loss_scaler
from kforge_cli.errors import KforgeError
from kforge_cli.rundir import names
from kforge_cli.rundir.claim import release_run_dir
from kforge_cli.rundir.data_positions import record_data_position
from kforge_cli.rundir.layout import RunDir
from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")

ModelBuilder = Callable[[JobSettings, RuntimeContext], tuple[nn.Module, PipelineBundle | None]]
DataBuilder = Callable[[JobSettings, RuntimeContext], TrainData]
LossBuilder = Callable[[JobSettings], LossFn]
OptimizerBuilder = Callable[[nn.Module, JobSettings, RuntimeContext], torch.optim.Optimizer]
SchedulerBuilder = Callable[[torch.optim.Optimizer, JobSettings], torch.optim.lr_scheduler.LRScheduler]
CheckpointerBuilder = Callable[[JobSettings, RuntimeContext, Path, RunParts], CheckpointManager]
TrackerBuilder = Callable[[JobSettings, RuntimeContext, Path, Mapping[str, str]], Tracker]
FeaturesBuilder = Callable[[JobSettings], Sequence[StepFeature]]
StepBuilder = Callable[[JobSettings, Sequence[StepFeature]], StepFn]
ComponentsBuilder = Callable[[JobSettings, int], Sequence[LoopComponent]]


def build_train_data(settings: JobSettings, runtime: RuntimeContext) -> TrainData:
    """This rank's training and validation data (text, or image/video-caption for a VLM)."""
    build = build_vlm_data if settings.vlm is not None else build_data
    return build(settings, dp_rank=runtime.dp_rank, dp_size=runtime.dp_size)


class SteadyStatePeakMemory(TrainHook):
    """Starts a new CUDA peak-memory window after this process's first step.

    The first step compiles, warms the allocator and creates the optimizer state; its peak
    is logged with it, and every later record then shows the steady-state peak.
    """

    def __init__(self) -> None:
        self.first_done = False

    def on_step_end(self, session: TrainingSession, info: StepInfo) -> None:
        if not self.first_done:
            self.first_done = True
            reset_peak_memory(session.runtime.device)


class TrackCheckpoints(TrainHook):
    """Records each saved checkpoint's step in the experiment trackers (rank 0 holds them)."""

    def on_checkpoint_save(self, session: TrainingSession, step: int, path: str) -> None:
        session.metrics.log_checkpoint(step, path)


def build_train_optimizer(model: nn.Module, settings: JobSettings, runtime: RuntimeContext) -> torch.optim.Optimizer:
    """The configured optimizer; with float8 FSDP all-gathers it also refreshes the weights' scales
    after each step (one amax all-reduce per step, not one per weight)."""
    optimizer = build_optimizer(model, settings.optimizer)
    if fsdp_float8_all_gather(settings.train, runtime):
        precompute_scales_after_each_step(optimizer, model)
    return optimizer


def build_train_scheduler(
    optimizer: torch.optim.Optimizer, settings: JobSettings
) -> torch.optim.lr_scheduler.LRScheduler:
    """The configured LR schedule over ``train.max_steps``, scaled by each ``data.phases`` entry."""
    return build_scheduler(optimizer, settings.scheduler, settings.train.max_steps, settings.data.phases)


def build_checkpointer(
    settings: JobSettings, runtime: RuntimeContext, run_dir: Path, parts: RunParts
) -> CheckpointManager:
    """kforge's checkpoint manager; ``checkpoint.init_from`` may name a Hugging Face model."""
    return CheckpointManager(settings, runtime, run_dir, parts, hf_loader=load_hf_weights)


def build_run_tracker(
    settings: JobSettings, runtime: RuntimeContext, run_dir: Path, run_ids: Mapping[str, str]
) -> Tracker:
    """metrics.jsonl and the configured experiment trackers on rank 0 (continuing a resumed run's ids)."""
    return build_tracker(
        settings, is_main=runtime.is_main, run_dir=run_dir, world_size=runtime.world_size, run_ids=run_ids
    )


@dataclass(frozen=True)
class Recipe:
    """A run's phases as data: each field a builder (see the module docstring), kforge's own by default."""

    model: ModelBuilder = build_parallel_model
    data: DataBuilder = build_train_data
    loss: LossBuilder = build_loss_fn
    optimizer: OptimizerBuilder = build_train_optimizer
    scheduler: SchedulerBuilder = build_train_scheduler
    checkpointer: CheckpointerBuilder = build_checkpointer
    tracker: TrackerBuilder = build_run_tracker
    features: FeaturesBuilder = features_for
    step: StepBuilder = build_step
    components: ComponentsBuilder = components_for
    hooks: tuple[LoopComponent, ...] = ()

    def with_phases(self, **phases: object) -> Recipe:
        """A copy with the named phases replaced (an unknown name is a TypeError)."""
        return dataclasses.replace(self, **phases)  # type: ignore[arg-type]


def assemble(
    settings: JobSettings,
    runtime: RuntimeContext,
    run_dir: Path,
    recipe: Recipe,
    stack: ExitStack,
    *,
    restore: bool = True,
    install_signals: bool = True,
) -> TrainingSession:
    """Build every piece of a run from ``recipe``; ``stack`` receives their cleanups (innermost last).

    ``restore=False`` skips resume/warm start and writing the run's config (tests); ``install_signals=False`` leaves the process's
    signal handlers alone (in-process tests).
    """
    shutdown = ShutdownHandler(settings.resilience.shutdown_signals if install_signals else [])
    if install_signals:
        shutdown.install()
    stack.callback(shutdown.close)
    loss_fn = recipe.loss(settings)
    model, pipeline = recipe.model(settings, runtime)
    optimizer = recipe.optimizer(model, settings, runtime)
    scheduler = recipe.scheduler(optimizer, settings)
    data = recipe.data(settings, runtime)
    state = TrainState()
    dtype = compute_dtype(settings, runtime.device)
    hooks = build_hooks(settings, [*recipe.hooks, TrackCheckpoints(), SteadyStatePeakMemory()])
    components = Components([*hooks, *recipe.components(settings, runtime.world_size)])
    nan = components.get(NanPolicy)
    update = Update(
        nan.guard if nan is not None else NanPolicy(settings.resilience).guard, build_loss_scaler(dtype, runtime)
    )
    if "update" in components.named():
        raise ValueError("a loop component may not be named 'update' (the optimizer update's part of a checkpoint)")
    named = {"update": update, **components.named()}
    checkpointer = recipe.checkpointer(
        settings, runtime, run_dir, RunParts(model, optimizer, scheduler, state, data.train, named)
    )
    stack.callback(checkpointer.close)
    if restore:
        restored = checkpointer.restore()  # resume (the data order too) or warm start, if any
        if runtime.is_main:  # accepted: config.toml on a new run, the changes beside it on a continued one
            write_config(settings, run_dir, choice=runtime.layout_choice)
        apply_recorded_skips(checkpointer, data.train, state)  # data a loss-spike rewind skipped from here
        if runtime.is_main:  # where this job's data begins (what `kforge data-trace` replays)
            record_data_position(
                run_dir, step=state.step, reason="start", data=data.train.state_dict(), world_size=runtime.world_size
            )
        maybe_mot_warm_start(settings, model, restored, checkpointer.groups.save)  # fresh runs only
    metrics = recipe.tracker(settings, runtime, run_dir, checkpointer.restored_metrics_run_ids)
    stack.enter_context(metrics)  # on an exception: the tracked run is marked failed (Ctrl-C: stopped)
    session = TrainingSession(
        settings=settings,
        runtime=runtime,
        run_dir=run_dir,
        model=model,
        pipeline=pipeline,
        optimizer=optimizer,
        scheduler=scheduler,
        update=update,
        loss_fn=loss_fn,
        data=data,
        components=components,
        metrics=metrics,
        shutdown=shutdown,
        checkpointer=checkpointer,
        step_fn=recipe.step(settings, recipe.features(settings)),
        compute_dtype=dtype,
        state=state,
    )
    checkpointer.report = metrics.write  # one metrics.jsonl record per save (bytes, seconds, MB/s, blocked)
    bind_pipeline_loss(session)
    n_eval = eval_batches(settings, pipeline=pipeline is not None)
    if settings.eval.interval and n_eval != settings.eval.steps and runtime.is_main:
        log.warning("eval.steps %d -> %d: the pipeline evaluates whole schedules", settings.eval.steps, n_eval)
    return session


def previous_hang_note(run_dir: Path) -> tuple[Path | None, str]:
    """Move the hang report of an earlier attempt of this run aside (logs/hang.N): (where, its first line).

    The summary is read only as a regular file kforge wrote (never through a link, capped), since
    its first line is printed to the terminal and the rank log.
    """
    moved = archive_previous(hang_dir(run_dir))
    if moved is None:
        return None, ""
    summary = moved / names.HANG_SUMMARY_FILE
    if not os.path.lexists(summary):
        return moved, "no summary was written"
    try:
        lines = read_own_file(summary).splitlines()
    except (OSError, KforgeError) as exc:
        return moved, f"its summary was not read: {exc}"
    return moved, lines[0] if lines else "an empty summary"


def _archive_hang_report(run_dir: Path) -> None:
    """Move the hang report of an earlier attempt of this run aside (logs/hang.N), and say so."""
    if hang_dir(run_dir).is_symlink():
        log.warning(
            "%s is a symbolic link: kforge never writes through it, so a hang of this run will leave no report; "
            "remove the link",
            hang_dir(run_dir),
        )
    moved, first = previous_hang_note(run_dir)
    if moved is not None:
        log.warning("an earlier attempt of this run hung (%s); its report is now in %s", first, moved)


def run_training(
    settings: JobSettings,
    recipe: Recipe | None = None,
    *,
    hooks: Sequence[LoopComponent] = (),
    **phases: object,
) -> TrainOutcome:
    """Train per `settings` with ``recipe`` (kforge's own by default), any phase replaced by keyword
    (``model=``, ``data=``, ``loss=``, ``optimizer=``, ``scheduler=``, ``checkpointer=``,
    ``tracker=``, ``features=``, ``step=``, ``components=``), ``hooks`` (any loop component)
    added to the recipe's.
    With the shrink policy (``slurm.min_nodes``) the layout is re-planned for the world size the
    job got before the process group starts (``engine.plan.shrink_replan``); the run's settings stay the
    configured ones. The process group is torn down only after a successful run."""
    recipe = (recipe or Recipe()).with_phases(**phases) if phases else (recipe or Recipe())
    if hooks:
        recipe = recipe.with_phases(hooks=(*recipe.hooks, *hooks))
    choice = replan_for_world(settings, detect_launch().world_size)  # slurm.min_nodes: the layout for what we got
    if choice is not None:
        settings = choice.settings
    runtime = init_runtime(settings)
    runtime.layout_choice = choice
    run_dir = resolve_run_dir(settings, runtime)  # rank 0 holds its lock until the run ends, however it ends
    with ExitStack() as stack:
        stack.callback(release_run_dir, run_dir)
        setup_logging(runtime.rank, runtime.world_size, RunDir(run_dir).logs)
        if runtime.is_main:
            log.info(building_line(settings.model, runtime))  # the banner follows once everything is built
            _archive_hang_report(run_dir)
        session = assemble(settings, runtime, run_dir, recipe, stack)
        if runtime.is_main:
            announce_start(session)  # the banner; a resumed job's marker in metrics.jsonl
        outcome = run_training_loop(session)  # every component hears how it ended, also on failure
        stopped = outcome.status == "stopped"  # by a signal: the tracker's run is KILLED; else it finished
        session.metrics.close("stopped" if stopped else "completed")
    teardown_runtime(runtime)
    return outcome
