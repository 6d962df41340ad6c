"""Tiny models and their training pieces, built the way `run_training` builds them (for unit tests)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kforge_cli.engine.checkpoint import CheckpointManager
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.observe import Tracker
from kforge_cli.engine.resilience import NanGuard
from kforge_cli.engine.runtime import RuntimeContext, init_runtime
from kforge_cli.engine.train.recipe import Recipe, assemble
from kforge_cli.engine.train.session import TrainingSession
from kforge_cli.engine.train.update import LossScaler
from kforge_cli.settings import JobSettings, load_settings
from tests.helpers.tiny import TINY_MODEL  # a 2-layer, 32-wide GQA model, fp32 on the CPU


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
class FakeData:
    """Training data for tests that never iterate it: a loader position the checkpoint must bring back."""

    train: FakeLoader = field(default_factory=FakeLoader)
    val: None = None
    vocab_size: int = 64
    dataset_names: list[str] = field(default_factory=list)


@dataclass
class TinyRun:
    """One process's model, optimizer, schedule and checkpoint manager over one run directory."""

    settings: JobSettings
    runtime: RuntimeContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    manager: CheckpointManager
    state: TrainState
    guard: NanGuard
    loader: FakeLoader
    grad_scaler: LossScaler | None
    session: TrainingSession


def tiny_session(run_dir: Path, settings: JobSettings, data: Any = None) -> TrainingSession:
    """A session assembled by kforge's own recipe (`assemble`), with ``data`` (default `FakeData`), no
    tracker, no restore and no signal handlers; its cleanups are left to the process's end."""
    recipe = Recipe(
        data=lambda _s, _r: data if data is not None else FakeData(),
        tracker=lambda *_: Tracker.null(),
    )
    runtime = init_runtime(settings)
    return assemble(settings, runtime, run_dir, recipe, ExitStack(), restore=False, install_signals=False)


def tiny_run(run_dir: Path, settings: JobSettings) -> TinyRun:
    """The pieces `run_training` builds before the loop, the manager holding all that it checkpoints."""
    session = tiny_session(run_dir, settings)
    loader = session.data.train
    assert isinstance(loader, FakeLoader)
    return TinyRun(
        settings=settings,
        runtime=session.runtime,
        model=session.model,
        optimizer=session.optimizer,
        scheduler=session.scheduler,
        manager=session.checkpointer,
        state=session.state,
        guard=session.nan_guard,
        loader=loader,
        grad_scaler=session.grad_scaler,
        session=session,
    )
