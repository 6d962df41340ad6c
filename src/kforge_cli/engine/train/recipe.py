"""`run_training`: the whole run as a recipe, one call per phase, top to bottom.

runtime -> run directory and logs -> shutdown/NaN -> loss -> model -> optimizer ->
scheduler -> data -> checkpoint manager -> restore -> tracker -> profiler -> session ->
loop -> teardown.

An experiment reuses this scaffold and swaps one phase with a keyword argument, each
defaulting to kforge's own: ``build_model`` (settings, runtime) -> (model, pipeline),
``build_data`` (settings, runtime) -> TrainData, ``step_fn`` (the step variant) and
``hooks`` (observers of the loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from kforge_cli.engine.checkpoint import CheckpointManager
from kforge_cli.engine.checkpoint.mot_convert import maybe_mot_warm_start
from kforge_cli.engine.data import TrainData, build_data
from kforge_cli.engine.data.vlm import build_vlm_data
from kforge_cli.engine.model import flops_per_token
from kforge_cli.engine.observe import (
    ProgressReporter,
    Tracker,
    TrainProfiler,
    build_profiler,
    build_tracker,
    device_peak_flops,
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
from kforge_cli.engine.resilience import NanGuard, ShutdownHandler
from kforge_cli.engine.runtime import RuntimeContext, dtype_name, init_runtime, teardown_runtime
from kforge_cli.engine.train.banner import announce_start, building_line
from kforge_cli.engine.train.evaluation import eval_batches
from kforge_cli.engine.train.hooks import StepInfo, build_hooks
from kforge_cli.engine.train.loop import TrainOutcome, run_training_loop
from kforge_cli.engine.train.loss import LossFn, build_loss_fn
from kforge_cli.engine.train.optimizer import build_optimizer
from kforge_cli.engine.train.pipeline_step import bind_pipeline_loss
from kforge_cli.engine.train.run_dir import release_run_dir, resolve_run_dir, write_config
from kforge_cli.engine.train.scheduler import build_scheduler
from kforge_cli.engine.train.session import TrainHook, TrainingSession
from kforge_cli.engine.train.step import StepFn
from kforge_cli.engine.train.steps import select_step_fn
from kforge_cli.engine.train.train_state import TrainState
from kforge_cli.engine.train.update import LossScaler, build_loss_scaler
from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")

ModelBuilder = Callable[[JobSettings, RuntimeContext], tuple[nn.Module, PipelineBundle | None]]
DataBuilder = Callable[[JobSettings, RuntimeContext], TrainData]


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


def build_session(
    settings: JobSettings,
    runtime: RuntimeContext,
    run_dir: Path,
    *,
    model: nn.Module,
    pipeline: PipelineBundle | None,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss_fn: LossFn,
    data: TrainData,
    checkpointer: CheckpointManager,
    metrics: Tracker,
    profiler: TrainProfiler,
    progress: ProgressReporter,
    nan_guard: NanGuard,
    shutdown: ShutdownHandler,
    state: TrainState,
    hooks: list[TrainHook] | None = None,
    grad_scaler: LossScaler | None = None,
) -> TrainingSession:
    """The session from its built pieces, plus what is derived from them (dtype, FLOPs, hooks)."""
    dtype = compute_dtype(settings, runtime.device)
    session = TrainingSession(
        settings=settings,
        runtime=runtime,
        run_dir=run_dir,
        model=model,
        pipeline=pipeline,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=loss_fn,
        data=data,
        hooks=build_hooks(settings, [*(hooks or []), TrackCheckpoints(), SteadyStatePeakMemory()]),
        metrics=metrics,
        progress=progress,
        profiler=profiler,
        nan_guard=nan_guard,
        shutdown=shutdown,
        checkpointer=checkpointer,
        compute_dtype=dtype,
        flops_per_token=flops_per_token(settings.model, settings.train.seq_len),
        peak_flops=device_peak_flops(runtime.device, dtype_name(dtype), settings.metrics.peak_tflops),
        state=state,
        grad_scaler=grad_scaler,
    )
    checkpointer.report = metrics.write  # one metrics.jsonl record per save (bytes, seconds, MB/s, blocked)
    bind_pipeline_loss(session)
    n_eval = eval_batches(settings, pipeline=pipeline is not None)
    if settings.eval.interval and n_eval != settings.eval.steps and runtime.is_main:
        log.warning("eval.steps %d -> %d: the pipeline evaluates whole schedules", settings.eval.steps, n_eval)
    return session


def run_training(
    settings: JobSettings,
    *,
    step_fn: StepFn | None = None,
    hooks: list[TrainHook] | None = None,
    build_model: ModelBuilder = build_parallel_model,
    build_data: DataBuilder = build_train_data,
) -> TrainOutcome:
    """Train per `settings`. The process group is torn down only after a successful run."""
    runtime = init_runtime(settings)
    run_dir = resolve_run_dir(settings, runtime)  # rank 0 holds its lock until the run ends, however it ends
    with ExitStack() as stack:
        stack.callback(release_run_dir, run_dir)
        setup_logging(runtime.rank, runtime.world_size, run_dir / "logs")
        if runtime.is_main:
            log.info(building_line(settings, runtime))  # the banner follows once everything is built
        if runtime.is_main:
            write_config(settings, run_dir)
        shutdown = ShutdownHandler(settings.resilience.shutdown_signals).install()
        stack.callback(shutdown.close)
        nan_guard = NanGuard.from_settings(settings.resilience)
        loss_fn = build_loss_fn(settings)
        model, pipeline = build_model(settings, runtime)
        optimizer = build_optimizer(model, settings)
        if fsdp_float8_all_gather(settings.train, runtime):  # one amax all-reduce per step, not one per weight
            precompute_scales_after_each_step(optimizer, model)
        scheduler = build_scheduler(optimizer, settings)
        data = build_data(settings, runtime)
        state = TrainState()
        grad_scaler = build_loss_scaler(compute_dtype(settings, runtime.device), runtime)  # fp16 only
        checkpointer = CheckpointManager(
            settings,
            runtime,
            run_dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            train_state=state,
            nan_guard=nan_guard,
            loader=data.train,
            grad_scaler=grad_scaler,
        )
        stack.callback(checkpointer.close)
        restored = checkpointer.restore()  # resume (the data order too) or warm start, if any
        maybe_mot_warm_start(settings, model, restored, checkpointer.groups.save)  # fresh runs only
        metrics = build_tracker(
            settings,
            is_main=runtime.is_main,
            run_dir=run_dir,
            world_size=runtime.world_size,
            run_ids=checkpointer.restored_metrics_run_ids,
        )
        stack.enter_context(metrics)  # on an exception: the tracked run is marked failed (Ctrl-C: stopped)
        profiler = build_profiler(settings.profiling, run_dir, runtime.rank, first_step=state.step + 1)
        stack.callback(profiler.close)
        progress = ProgressReporter(
            total_steps=settings.train.max_steps,
            start_step=state.step,
            mode=settings.metrics.progress_bar,
            enabled=runtime.is_main,
            logger=log,
        )
        stack.callback(progress.close)
        session = build_session(
            settings,
            runtime,
            run_dir,
            model=model,
            pipeline=pipeline,
            optimizer=optimizer,
            scheduler=scheduler,
            loss_fn=loss_fn,
            data=data,
            checkpointer=checkpointer,
            metrics=metrics,
            profiler=profiler,
            progress=progress,
            nan_guard=nan_guard,
            shutdown=shutdown,
            state=state,
            hooks=hooks,
            grad_scaler=grad_scaler,
        )
        if runtime.is_main:
            announce_start(session)  # the banner; a resumed job's marker in metrics.jsonl
        try:
            outcome = run_training_loop(session, step_fn or select_step_fn(settings))
        except BaseException:
            session.hooks.on_train_end(session, "failed")
            raise
        session.hooks.on_train_end(session, outcome.status)
        metrics.close(outcome.status)  # completed, or stopped by a signal (the tracker's run is KILLED)
    teardown_runtime(runtime)
    return outcome
