"""`run_training_loop`: the one training loop: fetch, step, update, log, ask the components, save.

Everything else that acts around the step is a loop component (`engine.train.components`):
the stop vote, the NaN policy, the hang watchdog, the straggler report, the profiler, the
loss-spike decision, in-loop evaluation, user hooks. The loop announces its phases, hands
each component the step's numbers and obeys the first verdict (rewind, stop); the checkpoint
manager says when to save (`CheckpointManager.save_reason`).

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

import torch

from kforge_cli.engine.observe import peak_memory_stats
from kforge_cli.engine.runtime import device_wait
from kforge_cli.engine.train.components import Rewind, Status, Stop
from kforge_cli.engine.train.session import StepInfo, TrainingSession
from kforge_cli.engine.train.step import Batch, StepResult
from kforge_cli.engine.train.update import apply_update

log = logging.getLogger("kforge")


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
    reason: str | None = None  # why the run stopped early (status early_stop)


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


def _log_step(session: TrainingSession, info: StepInfo, meter: _Meter) -> None:
    """One metrics record: the step's numbers are read from the device here (one transfer)."""
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
    record.update(peak_memory_stats(session.runtime.device))
    record.update(info.extra)  # e.g. per-dataset losses from the step function
    record.update(session.update.metrics())  # fp16: the loss scale
    names = session.data.dataset_names
    if len(names) > 1:  # tokens drawn per dataset so far (global; the loader's counters survive resumes)
        counts = session.data.train.state_dict()["counts"]
        for name, samples in zip(names, counts, strict=True):
            record[f"tokens/{name}"] = int(samples) * session.settings.train.seq_len
    session.components.on_log(session, record)  # MFU, NaN count, straggler report, the progress line
    session.metrics.write(record)


def _save(session: TrainingSession, reason: str | None, *, blocking: bool = False) -> bool:
    """Save the current step for ``reason`` (unless already saved or in flight); True when a checkpoint
    of it exists. ``blocking`` also waits for the save to be durable (the last save of a run)."""
    ckpt, step = session.checkpointer, session.state.step
    if reason is not None and ckpt.last_step != step:
        path = ckpt.save(step, reason=reason, metrics_run_ids=session.metrics.run_ids(), blocking=blocking or None)
        session.components.on_save(session, step, str(path))
    if blocking:
        ckpt.wait()
    return reason is not None


def _update(session: TrainingSession, result: StepResult, data_s: float) -> StepInfo:
    """The optimizer update of the step just computed; the step counter advances (also on skipped steps)."""
    s, state = session.settings.train, session.state
    step, lr = state.step + 1, session.current_lr()
    session.components.before_update(session)
    skipped = apply_update(session, step, result)  # the NaN policy and fp16 loss scaling decide
    session.optimizer.zero_grad(set_to_none=True)
    session.scheduler.step()  # also on skipped steps: the schedule never drifts from the step
    session.step_fn.after_update(session)
    state.step, state.tokens_seen = step, state.tokens_seen + session.tokens_per_step
    log_step = step % session.settings.metrics.log_interval == 0 or step == s.max_steps or step == 1
    info = StepInfo(step, lr, state.tokens_seen, 0.0, result, skipped, data_time_s=data_s, log_step=log_step)
    session.components.on_update(session, info)
    return info


def _end(session: TrainingSession, how: Stop, last: StepResult | None) -> TrainOutcome:
    """The last save (the checkpoint manager says whether) and how the run ended."""
    step = session.state.step
    session.components.phase("final", step)
    session.components.on_loop_end(session, how)  # NaN tallies, the last evaluation, a last spike check
    session.components.phase("checkpoint", step)
    saved = _save(session, session.checkpointer.save_reason(step, how.status), blocking=True)
    if how.status == "stopped":
        session.shutdown.saved_step = step  # a second Ctrl-C from here on exits 75, not 130
    return TrainOutcome(
        status=how.status,
        step=step,
        run_dir=session.run_dir,
        last_loss=last.read().loss if last is not None else None,
        last_eval_loss=session.components.last_eval_loss,
        signal=how.signal,
        checkpoint_saved=saved,
        reason=how.reason if how.status == "early_stop" else None,
    )


def run_training_loop(session: TrainingSession) -> TrainOutcome:
    """Train until train.max_steps, a shutdown signal (agreed by all ranks at a step boundary) or a
    component's stop; every component hears how it ended (``on_train_end``) and is closed.

    A hang watchdog thread watches the loop's progress (`engine.train.components.hang_watch`);
    when it fires it ends the process itself (exit 76), also when the main thread fails meanwhile.
    """
    components = session.components
    try:
        outcome = _train(session)
    except BaseException:
        components.on_train_end(session, "failed")
        raise
    finally:
        components.close()
    components.on_train_end(session, outcome.status)
    return outcome


def _train(session: TrainingSession) -> TrainOutcome:
    s, state, parts, device = session.settings.train, session.state, session.components, session.runtime.device
    batches, meter, last = iter(session.data.train), _Meter(), None
    parts.on_train_begin(session)
    while state.step < s.max_steps:
        parts.phase("stop vote", state.step)
        verdict = parts.before_step(session, state.step)
        if isinstance(verdict, Stop):
            return _end(session, verdict, last)
        t0 = time.perf_counter()
        parts.phase("data", state.step)
        micro = [_to_device(next(batches), device) for _ in range(s.grad_accum_steps)]
        data_s = time.perf_counter() - t0
        parts.phase("forward/backward", state.step)
        last = session.step_fn(session, micro)
        parts.phase("update", state.step)
        info = _update(session, last, data_s)
        if info.log_step:
            device_wait(device)  # the clock stops when the device has done the window's work (see _Meter)
        info.step_time_s = time.perf_counter() - t0
        meter.add(session.tokens_per_step, info.step_time_s)
        if info.log_step:
            parts.phase("log", info.step)
            _log_step(session, info, meter)
        parts.phase("hooks", info.step)
        verdict = parts.after_update(session, info)  # hooks, a spike decision, evaluation, early stop
        if isinstance(verdict, Rewind):
            batches, _ = iter(session.data.train), meter.reset()  # from the position after the skipped window
            parts.on_rewind(session)
            continue
        if isinstance(verdict, Stop):
            return _end(session, verdict, last)
        parts.phase("checkpoint", info.step)
        session.checkpointer.poll()  # commit a finished async save
        _save(session, session.checkpointer.save_reason(info.step))
    return _end(session, Stop("completed", "train.max_steps"), last)
