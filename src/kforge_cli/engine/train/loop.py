"""`run_training_loop`: the one training loop (step, NaN policy, schedule, logs, eval, stop).

The loop reads nothing from the device on an ordinary step: the step's numbers stay device
scalars (`StepResult`) and are read on logging steps, the NaN policy decides on the device
where it can (`engine.train.update`), and ranks vote on stopping every
``resilience.stop_check_interval`` steps over a host-side group (`StopVote`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kforge_cli.engine.observe import mfu, peak_memory_stats
from kforge_cli.engine.resilience import (
    HangWatchdog,
    NullWatchdog,
    StopVote,
    StragglerMonitor,
    hang_dir,
    local_parameter_count,
)
from kforge_cli.engine.runtime import device_wait, process_group_timeout_s
from kforge_cli.engine.train.downstream import downstream_eval
from kforge_cli.engine.train.evaluation import evaluate
from kforge_cli.engine.train.rewind import handle_spike, settle_spikes
from kforge_cli.engine.train.session import StepInfo, TrainingSession
from kforge_cli.engine.train.step import Batch, StepResult
from kforge_cli.engine.train.update import apply_update

log = logging.getLogger("kforge")

Status = Literal["completed", "stopped"]


@dataclass
class TrainOutcome:
    """How the loop ended; the CLI turns it into a message and an exit code."""

    status: Status
    step: int
    run_dir: Path
    last_loss: float | None
    last_eval_loss: float | None
    signal: str | None = None
    checkpoint_saved: bool = False


class _Meter:
    """Throughput over the steps since the last log line (excludes eval and logging time).

    Each step is clocked from its start until its work is queued, and on a logging step until
    the device has finished it (`device_wait`): the host runs ahead of the GPU on ordinary
    steps, so the window's total reaches the point where all its device work is done, and
    tokens_per_sec / mfu measure the device, not the queueing. Ordinary steps gain no sync.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.steps = 0
        self.seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.seconds += seconds

    def take(self) -> tuple[float, float]:
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        step_time = self.seconds / self.steps if self.steps else 0.0
        self.reset()
        return tps, step_time


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def _log_step(session: TrainingSession, info: StepInfo, meter: _Meter, straggler: StragglerMonitor | None) -> None:
    """One metrics record: the step's numbers are read from the device here (one transfer)."""
    session.nan_guard.settle()  # every rank, the same steps: the abort decision stays agreed
    tps, step_time = meter.take()
    record: dict[str, object] = {
        "step": info.step,
        "loss": info.loss,
        "lr": info.lr,
        "grad_norm": info.grad_norm,
        "tokens_seen": info.tokens_seen,
        "tokens_per_sec": tps,
        "step_time_s": step_time,
    }
    util = mfu(session.flops_per_token, tps, session.runtime.world_size, session.peak_flops)
    if util is not None:
        record["mfu"] = util
    if session.nan_guard.total_bad:
        record["nan_steps"] = session.nan_guard.total_bad
    record.update(peak_memory_stats(session.runtime.device))
    record.update(info.extra)  # e.g. per-dataset losses from the step function
    if session.grad_scaler is not None:
        record.update(session.grad_scaler.metrics())
    if straggler is not None:
        record.update(straggler.report(info.step))  # one all-gather, every rank
    names = session.data.dataset_names
    if len(names) > 1:  # tokens drawn per dataset so far (global; the loader's counters survive resumes)
        counts = session.data.train.state_dict()["counts"]
        for name, samples in zip(names, counts, strict=True):
            record[f"tokens/{name}"] = int(samples) * session.settings.train.seq_len
    session.metrics.write(record)
    session.progress.update(info.step, record)


def _run_eval(session: TrainingSession) -> float | None:
    eval_loss = evaluate(session)
    step = session.state.step
    downstream = downstream_eval(session)  # eval.tasks (multiple choice), on every rank
    if downstream:
        session.metrics.write({"step": step, **downstream})
    if eval_loss is None:
        return None
    session.metrics.write({"step": step, "eval_loss": eval_loss})
    session.progress.log_eval(step, eval_loss)
    session.hooks.on_eval_end(session, step, eval_loss)
    return eval_loss


def _save_checkpoint(session: TrainingSession, reason: str, *, blocking: bool | None = None) -> bool:
    """Save the current step (unless already saved or in flight); True when a checkpoint of it exists.

    `blocking` also waits for the save to be durable (signal and final saves).
    """
    ckpt = session.checkpointer
    step = session.state.step
    if ckpt.last_step != step:
        path = ckpt.save(step, reason=reason, metrics_run_ids=session.metrics.run_ids(), blocking=blocking)
        session.hooks.on_checkpoint_save(session, step, str(path))
    if blocking:
        ckpt.wait()
    return True


def _watchdog(session: TrainingSession) -> HangWatchdog | NullWatchdog:
    """The hang watchdog of this rank (started), or a no-op when ``resilience.hang_timeout_s = 0``."""
    r = session.settings.resilience
    if r.hang_timeout_s == 0:
        return NullWatchdog()
    ckpt = session.checkpointer

    def note() -> str:
        return f" (last saved: step {ckpt.last_step})" if ckpt.last_step is not None else " (none saved yet)"

    return HangWatchdog(
        rank=session.runtime.rank,
        world_size=session.runtime.world_size,
        directory=hang_dir(session.run_dir),
        timeout_s=r.hang_timeout_s,
        pg_timeout_s=process_group_timeout_s(session.settings),
        resume_note=note,
    ).start()


def _straggler(session: TrainingSession) -> StragglerMonitor | None:
    """The straggler report of this rank, or None (one process, or ``resilience.straggler_ratio = 0``)."""
    r, runtime = session.settings.resilience, session.runtime
    if r.straggler_ratio == 0 or runtime.world_size < 2:
        return None
    return StragglerMonitor(
        rank=runtime.rank,
        world_size=runtime.world_size,
        device=runtime.device,
        ratio=r.straggler_ratio,
        windows=r.straggler_windows,
        local_params=local_parameter_count(session.model),
    )


def run_training_loop(session: TrainingSession) -> TrainOutcome:
    """Train until train.max_steps or a shutdown signal (agreed by all ranks at a step boundary).

    A hang watchdog thread watches the loop's progress (`engine.resilience.hang`); when it
    fires it ends the process itself (exit 76), also when the main thread fails meanwhile.
    """
    watchdog = _watchdog(session)
    try:
        return _train(session, watchdog)
    except BaseException:
        watchdog.wait_if_fired()  # a peer that exited on a hang breaks our collective: exit as a hang too
        raise
    finally:
        watchdog.stop()


def _train(session: TrainingSession, watchdog: HangWatchdog | NullWatchdog) -> TrainOutcome:
    s = session.settings
    state, device = session.state, session.runtime.device
    batches = iter(session.data.train)
    meter = _Meter()
    last: StepResult | None = None
    last_eval: float | None = None
    stop = StopVote(session.shutdown, s.resilience.stop_check_interval, distributed=session.runtime.world_size > 1)
    session.hooks.on_train_begin(session)
    mark = watchdog.mark
    straggler = _straggler(session)
    spikes = session.spike_guard
    while state.step < s.train.max_steps:
        mark("stop vote")
        if stop.should_stop(state.step):
            log.warning("stopping at step %d (%s)", state.step, session.shutdown.signal_name)
            session.nan_guard.settle()
            event = settle_spikes(session)
            if event is not None:
                mark("rewind")
                handle_spike(session, event)  # a rewind leaves the last checkpoint as the one to resume
            mark("checkpoint")
            saved = _save_checkpoint(session, "signal", blocking=True)
            session.shutdown.saved_step = state.step  # a second Ctrl-C from here on exits 75, not 130
            return TrainOutcome(
                status="stopped",
                step=state.step,
                run_dir=session.run_dir,
                last_loss=last.read().loss if last is not None else None,
                last_eval_loss=last_eval,
                signal=session.shutdown.signal_name,
                checkpoint_saved=saved,
            )
        t0 = time.perf_counter()
        mark("data")
        micro = [_to_device(next(batches), device) for _ in range(s.train.grad_accum_steps)]
        data_s = time.perf_counter() - t0
        mark("forward/backward")
        result = session.step_fn(session, micro)
        step = state.step + 1
        lr = session.current_lr()
        mark("update")
        timing = straggler.begin_update() if straggler is not None else None
        skipped = apply_update(session, step, result)  # the NaN policy and fp16 loss scaling decide
        session.optimizer.zero_grad(set_to_none=True)
        session.scheduler.step()  # also on skipped steps: the schedule never drifts from the step
        session.step_fn.after_update(session)
        if straggler is not None and timing is not None:
            straggler.end_update(timing, data_s)
        state.step = step
        state.tokens_seen += session.tokens_per_step
        log_now = step % s.metrics.log_interval == 0 or step == s.train.max_steps or step == 1
        if spikes.enabled:
            spikes.observe(step, result.loss)  # on the device; decided at logging steps and before saves
        if log_now:
            device_wait(device)  # the clock stops when the device has done the window's work (see _Meter)
        elapsed = time.perf_counter() - t0
        watchdog.beat(step)
        meter.add(session.tokens_per_step, elapsed)
        session.profiler.step(step)
        last = result
        info = StepInfo(
            step=step, lr=lr, tokens_seen=state.tokens_seen, step_time_s=elapsed, result=result, skipped_flag=skipped
        )
        if log_now:
            mark("log")
            _log_step(session, info, meter, straggler)
        mark("hooks")
        session.hooks.on_step_end(session, info)
        if spikes.enabled and (log_now or session.checkpointer.due(step)):
            mark("spike check")
            event = settle_spikes(session)  # every rank, the same steps: one broadcast
            if event is not None:
                mark("rewind")  # restoring a checkpoint may take long: the slow phases' limit
            if event is not None and handle_spike(session, event):
                batches = iter(session.data.train)  # from the position after the skipped window
                meter.reset()
                if straggler is not None:
                    straggler.reset()
                watchdog.restart_timing()
                continue
        if s.eval.interval and step % s.eval.interval == 0:
            mark("eval")
            last_eval = _run_eval(session)
        mark("checkpoint")
        session.checkpointer.poll()  # commit a finished async save
        if session.checkpointer.due(step):
            _save_checkpoint(session, "interval")
    mark("final")
    session.nan_guard.settle()
    if s.eval.interval and state.step % s.eval.interval != 0:
        last_eval = _run_eval(session)
    if s.checkpoint.save_final:
        _save_checkpoint(session, "final", blocking=True)
    else:
        session.checkpointer.wait()
    last_loss = last.read().loss if last is not None else None
    return TrainOutcome(
        status="completed", step=state.step, run_dir=session.run_dir, last_loss=last_loss, last_eval_loss=last_eval
    )
