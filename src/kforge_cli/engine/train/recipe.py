"""`run_training`: the whole run as a recipe, one call per phase, top to bottom.

runtime -> shutdown/NaN -> loss -> model -> optimizer -> scheduler -> checkpoint manager
-> restore -> tracker -> profiler -> data -> eval data -> phases -> session -> loop -> teardown.
An experiment can reuse this scaffold and swap one phase (e.g. `step_fn`) without editing it.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack

from kforge_cli.engine.checkpoint import CheckpointManager
from kforge_cli.engine.checkpoint.mot_convert import maybe_mot_warm_start
from kforge_cli.engine.data import build_data
from kforge_cli.engine.data.vlm import build_vlm_data
from kforge_cli.engine.model import flops_per_token
from kforge_cli.engine.observe import (
    ProgressReporter,
    build_profiler,
    build_tracker,
    device_peak_flops,
    setup_logging,
)
from kforge_cli.engine.parallel import build_parallel_model, compute_dtype
from kforge_cli.engine.resilience import NanGuard, ShutdownHandler
from kforge_cli.engine.runtime import init_runtime, teardown_runtime
from kforge_cli.engine.train.hooks import TrainHook, build_hooks
from kforge_cli.engine.train.loop import TrainOutcome, run_training_loop
from kforge_cli.engine.train.loss import build_loss_fn
from kforge_cli.engine.train.optimizer import build_optimizer
from kforge_cli.engine.train.run_dir import resolve_run_dir, write_config
from kforge_cli.engine.train.scheduler import build_scheduler
from kforge_cli.engine.train.session import TrainingSession, TrainState
from kforge_cli.engine.train.step import StepFn, select_step_fn
from kforge_cli.settings import JobSettings

log = logging.getLogger("kforge")

_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


class TrackCheckpoints(TrainHook):
    """Records each saved checkpoint's step in the experiment trackers (rank 0 holds them)."""

    def on_checkpoint_save(self, session: TrainingSession, step: int, path: str) -> None:
        if session.metrics is not None:
            session.metrics.log_checkpoint(step, path)


def run_training(
    settings: JobSettings, *, step_fn: StepFn | None = None, hooks: list[TrainHook] | None = None
) -> TrainOutcome:
    """Train per `settings`. The process group is torn down only after a successful run."""
    runtime = init_runtime(settings)
    run_dir = resolve_run_dir(settings, runtime)
    setup_logging(runtime.rank, runtime.world_size, run_dir / "logs")
    if runtime.threads is not None:
        log.info(runtime.threads.describe())
    if runtime.is_main:
        write_config(settings, run_dir)
    with ExitStack() as stack:
        shutdown = ShutdownHandler(settings.resilience.shutdown_signals).install()
        stack.callback(shutdown.close)
        nan_guard = NanGuard.from_settings(settings.resilience)
        loss_fn = build_loss_fn(settings)
        model, pipeline = build_parallel_model(settings, runtime)
        optimizer = build_optimizer(model, settings)
        scheduler = build_scheduler(optimizer, settings)
        state = TrainState()
        checkpointer = CheckpointManager(
            settings, runtime, run_dir, model=model, optimizer=optimizer, scheduler=scheduler
        )
        stack.callback(checkpointer.close)
        checkpointer.restore(progress=state, nan_guard=nan_guard)  # resume or warm start, if any
        maybe_mot_warm_start(settings, model, checkpointer.restored, checkpointer.groups.save)  # fresh runs only
        metrics = build_tracker(
            settings,
            is_main=runtime.is_main,
            run_dir=run_dir,
            world_size=runtime.world_size,
            run_ids=checkpointer.restored_metrics_run_ids,
        )
        if metrics is not None:
            stack.enter_context(metrics)  # on an exception: the tracked run is marked failed (Ctrl-C: stopped)
        profiler = build_profiler(settings.profiling, run_dir, runtime.rank, first_step=state.step + 1)
        stack.callback(profiler.close)
        data = (build_vlm_data if settings.vlm is not None else build_data)(
            settings, dp_rank=runtime.dp_rank, dp_size=runtime.dp_size
        )
        checkpointer.bind_data(data.train)  # a resume continues the data order exactly
        progress = ProgressReporter(
            total_steps=settings.train.max_steps,
            start_step=state.step,
            mode=settings.metrics.progress_bar,
            enabled=runtime.is_main,
            logger=log,
        )
        stack.callback(progress.close)
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
            hooks=build_hooks(settings, [*(hooks or []), TrackCheckpoints()]),
            metrics=metrics,
            progress=progress,
            profiler=profiler,
            nan_guard=nan_guard,
            shutdown=shutdown,
            compute_dtype=dtype,
            flops_per_token=flops_per_token(settings.model, settings.train.seq_len),
            peak_flops=device_peak_flops(runtime.device, _DTYPE_NAMES[str(dtype)], settings.metrics.peak_tflops),
            state=state,
            checkpointer=checkpointer,
        )
        log.info(
            "training %s on %d process(es), device %s, run dir %s",
            settings.profile or "custom config",
            runtime.world_size,
            runtime.device,
            run_dir,
        )
        try:
            outcome = run_training_loop(session, step_fn or select_step_fn(settings))
        except BaseException:
            session.hooks.on_train_end(session, "failed")
            raise
        session.hooks.on_train_end(session, outcome.status)
        if metrics is not None:
            metrics.close(outcome.status)  # completed, or stopped by a signal (the tracker's run is KILLED)
    teardown_runtime(runtime)
    return outcome
