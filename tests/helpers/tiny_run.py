"""Tiny models and their training pieces, built the way `run_training` builds them (for unit tests)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.checkpoint import CheckpointManager
from kforge_cli.engine.observe import ProgressReporter, Tracker, build_profiler
from kforge_cli.engine.parallel import build_parallel_model, compute_dtype
from kforge_cli.engine.resilience import NanGuard, ShutdownHandler
from kforge_cli.engine.runtime import RuntimeContext, init_runtime
from kforge_cli.engine.train.loss import build_loss_fn
from kforge_cli.engine.train.optimizer import build_optimizer
from kforge_cli.engine.train.recipe import build_session
from kforge_cli.engine.train.scheduler import build_scheduler
from kforge_cli.engine.train.session import TrainingSession
from kforge_cli.engine.train.train_state import TrainState
from kforge_cli.engine.train.update import LossScaler, build_loss_scaler
from kforge_cli.settings import JobSettings, load_settings

# A 2-layer, 32-wide GQA model over a 64-token vocabulary, fp32 on the CPU.
TINY_MODEL = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=64",
    "--model.max_seq_len=32",
    "--train.seq_len=16",
    "--train.device=cpu",
    "--train.mixed_precision=fp32",
]


def tiny_settings(*overrides: str) -> JobSettings:
    """TINY_MODEL plus ``overrides`` (later ones win), without the environment."""
    return load_settings(overrides=[*TINY_MODEL, *overrides], use_env=False).settings


class FakeLoader:
    """Stands in for the data loader in checkpoint tests: a position that must come back exactly."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


@dataclass
class TinyRun:
    """One process's model, optimizer, schedule and checkpoint manager over one run directory."""

    settings: JobSettings
    runtime: RuntimeContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    manager: CheckpointManager
    state: TrainState = field(default_factory=TrainState)
    guard: NanGuard | None = None
    loader: FakeLoader = field(default_factory=FakeLoader)
    grad_scaler: LossScaler | None = None


def tiny_run(run_dir: Path, settings: JobSettings) -> TinyRun:
    """The pieces `run_training` builds before the loop, the manager holding all that it checkpoints."""
    runtime = init_runtime(settings)
    model, _ = build_parallel_model(settings, runtime)
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings)
    state, guard, loader = TrainState(), NanGuard.from_settings(settings.resilience), FakeLoader()
    scaler = build_loss_scaler(compute_dtype(settings, runtime.device), runtime)
    manager = CheckpointManager(
        settings,
        runtime,
        run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_state=state,
        nan_guard=guard,
        loader=loader,
        grad_scaler=scaler,
    )
    return TinyRun(settings, runtime, model, optimizer, scheduler, manager, state, guard, loader, scaler)


def tiny_session(run_dir: Path, settings: JobSettings, data: Any = None) -> TrainingSession:
    """A `TrainingSession` from `build_session` (no tracker, profiler off, no signals handled)."""
    run = tiny_run(run_dir, settings)
    return build_session(
        settings,
        run.runtime,
        run_dir,
        model=run.model,
        pipeline=None,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        loss_fn=build_loss_fn(settings),
        data=data,
        checkpointer=run.manager,
        metrics=Tracker.null(),
        profiler=build_profiler(settings.profiling, run_dir, 0),
        progress=ProgressReporter(1, 0, "off", False, logging.getLogger("kforge")),
        nan_guard=run.guard or NanGuard.from_settings(settings.resilience),
        shutdown=ShutdownHandler([]),
        state=run.state,
        grad_scaler=run.grad_scaler,
    )
