"""`TrainingSession`: every piece of a run, built once by `run_training` and passed explicitly."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kforge_cli.engine.observe import ProgressReporter, Tracker, TrainProfiler
from kforge_cli.engine.parallel import PipelineBundle
from kforge_cli.engine.resilience import NanGuard, ShutdownHandler
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.engine.train.hooks import HookList
from kforge_cli.engine.train.loss import LossFn
from kforge_cli.settings import JobSettings


@dataclass
class TrainState:
    """Progress that a checkpoint must carry (JSON-serialisable)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


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
    data: Any  # engine.data.DataBundle
    hooks: HookList
    metrics: Tracker | None  # rank 0 only: metrics.jsonl and the experiment trackers
    progress: ProgressReporter
    profiler: TrainProfiler
    nan_guard: NanGuard
    shutdown: ShutdownHandler
    compute_dtype: torch.dtype
    flops_per_token: float
    peak_flops: float | None
    checkpointer: Any = None  # engine.checkpoint.CheckpointManager when built
    state: TrainState = field(default_factory=TrainState)

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def tokens_per_step(self) -> int:
        """Global tokens consumed by one optimizer step (all data-parallel ranks)."""
        t = self.settings.train
        return t.batch_size * t.seq_len * t.grad_accum_steps * self.runtime.dp_size

    def autocast(self) -> AbstractContextManager[Any]:
        """Mixed precision for a single-device model (FSDP2 casts parameters itself)."""
        if self.compute_dtype == torch.float32 or self.runtime.world_size > 1:
            return nullcontext()
        return torch.autocast(device_type=self.runtime.device.type, dtype=self.compute_dtype)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
