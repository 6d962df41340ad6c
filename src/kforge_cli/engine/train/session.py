"""`TrainingSession`: every piece of a run, assembled once by `engine.train.recipe.assemble`,
and the hook interface the loop calls on it (`TrainHook`, `HookList`, `StepInfo`).

The hook interface lives here, next to the session its methods receive, so that neither
module imports the other; `engine.train.hooks` loads hooks named in the settings.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from kforge_cli.engine.checkpoint import CheckpointManager
from kforge_cli.engine.data import TrainData
from kforge_cli.engine.observe import ProgressReporter, Tracker, TrainProfiler
from kforge_cli.engine.parallel import PipelineBundle
from kforge_cli.engine.resilience import NanGuard, ShutdownHandler, SpikeGuard
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.engine.train.loss import LossFn
from kforge_cli.engine.train.train_state import TrainState
from kforge_cli.settings import JobSettings

if TYPE_CHECKING:
    from kforge_cli.engine.train.loss_scaler import LossScaler
    from kforge_cli.engine.train.step.result import StepResult

Batch = dict[str, torch.Tensor]
"""One micro-batch on the device: ``input_ids``, ``labels`` and optional model inputs."""


class StepFn(Protocol):
    """What the loop calls: the step once per optimizer step, `after_update` after the optimizer update.

    kforge's are an executor with features (engine.train.step, engine.train.features).
    """

    def __call__(self, session: TrainingSession, micro_batches: list[Batch], /) -> StepResult: ...

    def after_update(self, session: TrainingSession, /) -> None: ...


@dataclass
class StepInfo:
    """What a finished optimizer step produced (all values global across ranks).

    ``loss``, ``grad_norm``, ``extra`` and ``skipped`` are read from the device when first
    asked for: a hook that reads them every step adds a device sync to every step, so read
    them on the steps you log.
    """

    step: int
    lr: float
    tokens_seen: int
    step_time_s: float
    result: StepResult
    skipped_flag: bool | torch.Tensor = False  # a device flag when the update was decided on the device

    @property
    def loss(self) -> float:
        return self.result.read().loss

    @property
    def grad_norm(self) -> float:
        """Before clipping (and before gradients are zeroed)."""
        return self.result.read().grad_norm

    @property
    def extra(self) -> dict[str, float]:
        return self.result.read().extra

    @property
    def skipped(self) -> bool:
        return bool(self.skipped_flag)


class TrainHook:
    """Observe (or steer) a run without editing the loop: subclass and override what you need.

    Register hooks from Python (`run_training(settings, hooks=[MyHook()])`) or from settings
    by import path (`train.hooks = ["my_pkg.hooks:LogGradNorms"]`, see `engine.train.hooks`).
    Every method is a no-op here.
    """

    def on_train_begin(self, session: TrainingSession) -> None: ...

    def on_step_end(self, session: TrainingSession, info: StepInfo) -> None: ...

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None: ...

    def on_checkpoint_save(self, session: TrainingSession, step: int, path: str) -> None: ...

    def on_train_end(self, session: TrainingSession, status: str) -> None: ...


class HookList(TrainHook):
    """Calls every hook in order."""

    def __init__(self, hooks: list[TrainHook]) -> None:
        self.hooks = list(hooks)

    def on_train_begin(self, session: TrainingSession) -> None:
        for h in self.hooks:
            h.on_train_begin(session)

    def on_step_end(self, session: TrainingSession, info: StepInfo) -> None:
        for h in self.hooks:
            h.on_step_end(session, info)

    def on_eval_end(self, session: TrainingSession, step: int, eval_loss: float) -> None:
        for h in self.hooks:
            h.on_eval_end(session, step, eval_loss)

    def on_checkpoint_save(self, session: TrainingSession, step: int, path: str) -> None:
        for h in self.hooks:
            h.on_checkpoint_save(session, step, path)

    def on_train_end(self, session: TrainingSession, status: str) -> None:
        for h in self.hooks:
            h.on_train_end(session, status)


@dataclass
class TrainingSession:
    """The assembled run. Fields are plain attributes so an experiment can swap one piece."""

    settings: JobSettings
    runtime: RuntimeContext
    run_dir: Path
    model: nn.Module
    pipeline: PipelineBundle | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_fn: LossFn
    data: TrainData
    hooks: HookList
    metrics: Tracker  # rank 0: metrics.jsonl and the experiment trackers; other ranks: the null tracker
    progress: ProgressReporter
    profiler: TrainProfiler
    nan_guard: NanGuard
    shutdown: ShutdownHandler
    checkpointer: CheckpointManager
    step_fn: StepFn  # an executor with its features (engine.train.features.build_step)
    compute_dtype: torch.dtype
    flops_per_token: float
    peak_flops: float | None
    state: TrainState = field(default_factory=TrainState)
    grad_scaler: LossScaler | None = None  # fp16 only (engine.train.update)
    spike_guard: SpikeGuard = field(default_factory=lambda: SpikeGuard("off", 100, 6.0, 1.2, 0))  # engine.train.rewind

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def tokens_per_step(self) -> int:
        """Global tokens consumed by one optimizer step (all data-parallel ranks)."""
        return self.settings.train.tokens_per_step(self.runtime.dp_size)

    def autocast(self) -> AbstractContextManager[Any]:
        """Mixed precision for a single-device model (FSDP2 casts parameters itself)."""
        if self.compute_dtype == torch.float32 or self.runtime.world_size > 1:
            return nullcontext()
        return torch.autocast(device_type=self.runtime.device.type, dtype=self.compute_dtype)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
