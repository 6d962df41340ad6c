"""Restoring a run: rank 0 decides what to load (`RestoreDecision`), every rank loads it.

The decision is made once on rank 0 (shared filesystems disagree between nodes) and
broadcast as a small dataclass; an error on rank 0 travels in it, so every rank raises
the same error instead of waiting forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from kforge_cli.engine.checkpoint.dcp_io import (
    apply_training_state_dict,
    load_from_dirs,
    load_model_weights,
    training_state_dict,
)
from kforge_cli.engine.checkpoint.groups import CheckpointGroups
from kforge_cli.engine.checkpoint.reader import metrics_run_ids
from kforge_cli.engine.checkpoint.resolve import RestoreDecision, Stateful, check_compatible, decide_restore
from kforge_cli.engine.checkpoint.train_state import read_rank_state, restore_rng
from kforge_cli.engine.runtime import seed_everything
from kforge_cli.errors import KforgeError
from kforge_cli.settings import JobSettings
from kforge_cli.settings.training import ModelSettings

log = logging.getLogger("kforge")


HFLoader = Callable[[nn.Module, Path, ModelSettings, list[str]], list[str]]
"""Loads a Hugging Face directory's weights into a model, returns the names it loaded.

``checkpoint.init_from`` may name a Hugging Face model; reading one is interop's job (a layer
above this one), so the manager is handed the loader instead of importing it.
"""


class NamedPart(Protocol):
    """A part of the run a checkpoint carries under its name without knowing what it is.

    ``legacy_state(train_state)`` finds its state in a checkpoint written before it had its own
    name (None: none there); checkpoints then kept each such part at the top of the train state.
    """

    def state_dict(self) -> object: ...

    def load_state_dict(self, state: object) -> None: ...

    def legacy_state(self, train_state: Mapping[str, object]) -> object: ...


@dataclass(frozen=True)
class RunParts:
    """The pieces of a run a checkpoint holds: `restore` loads into them, `save` writes them.

    ``named``: every other part with state (the update, the loop components), saved in the
    train state under ``parts.<name>`` (plain JSON values).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_state: Stateful
    loader: Stateful | None = None
    named: Mapping[str, NamedPart] = field(default_factory=dict)

    def named_states(self) -> dict[str, object]:
        """Every named part's state (the train state's ``parts``)."""
        return {name: part.state_dict() for name, part in self.named.items()}

    def load_named(self, state: Mapping[str, Any], path: Path) -> None:
        """Give each named part its saved state: under ``parts``, or where an older checkpoint kept it."""
        saved = state.get("parts")
        saved = saved if isinstance(saved, dict) else {}
        for name, part in self.named.items():
            value = saved[name] if name in saved else part.legacy_state(state)
            if value is None:
                log.info("checkpoint %s has no state for %s: it starts fresh", path, name)
                continue
            part.load_state_dict(value)
        unused = sorted(set(saved) - set(self.named))
        if unused:
            log.info("checkpoint %s: state of %s not used by this run", path, ", ".join(unused))


@dataclass
class CheckpointedState:
    """Everything a checkpoint holds for one rank, and where the run's checkpoints live."""

    settings: JobSettings
    groups: CheckpointGroups
    root: Path
    fingerprint: str
    shaping: dict[str, object]
    parts: RunParts
    hf_loader: HFLoader | None = None

    @property
    def is_main(self) -> bool:
        return self.groups.rank == 0


@dataclass
class Restored:
    """What `restore` loaded; `metrics_run_ids` lets trackers continue the same runs."""

    kind: Literal["resume", "warm_start"]
    path: Path
    step: int
    metrics_run_ids: dict[str, str]


def _decide(manager: CheckpointedState, *, own_only: bool = False) -> RestoreDecision:
    decision = RestoreDecision()
    cfg = manager.settings.checkpoint
    if own_only:  # a rewind: this run's own newest checkpoint (or where it started from), never a warm start
        cfg = cfg.model_copy(update={"resume": "auto", "init_from": None})
    if manager.is_main:
        try:
            decision = decide_restore(cfg, manager.root)
        except KforgeError as exc:
            decision = RestoreDecision(error=str(exc), unsafe=isinstance(exc, UnsafeCheckpointError))
    decision = manager.groups.broadcast(decision)
    decision.raise_error()
    return decision


def restore_run(manager: CheckpointedState, *, own_only: bool = False) -> Restored | None:
    """Load what rank 0 decided into the manager's pieces (collective); ``own_only``: the run's own
    newest complete checkpoint (or its ``load_path``), for an in-process rewind."""
    decision = _decide(manager, own_only=own_only)
    if decision.kind is None or decision.path is None:
        return None
    path, cfg = decision.path, manager.settings.checkpoint
    if decision.kind == "warm_start_hf":
        if manager.hf_loader is None:
            raise CheckpointError(
                f"checkpoint.init_from = {path} is a Hugging Face model, and this run has no loader for one"
            )
        names = manager.hf_loader(manager.parts.model, path, manager.settings.model, list(cfg.exclude_from_loading))
        log.info("warm start: loaded %d tensors from Hugging Face %s (fresh optimizer, step 0)", len(names), path)
        return Restored(kind="warm_start", path=path, step=0, metrics_run_ids={})
    if decision.kind == "warm_start":
        names = load_model_weights(
            manager.parts.model, decision.dirs, list(cfg.exclude_from_loading), manager.groups.save
        )
        log.info("warm start: loaded %d tensors from %s (fresh optimizer, step 0)", len(names), path)
        return Restored(kind="warm_start", path=path, step=0, metrics_run_ids={})
    return _resume(manager, decision, path)


def _resume(manager: CheckpointedState, decision: RestoreDecision, path: Path) -> Restored:
    state = decision.train_state
    check_compatible(state, path, manager.fingerprint, manager.shaping, manager.settings)
    tensors = training_state_dict(manager.parts.model, manager.parts.optimizer)
    missing = load_from_dirs(tensors, decision.dirs, manager.groups.save, manager.settings.checkpoint.load_threads)
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensors this run needs, e.g. {sorted(missing)[:5]}")
    apply_training_state_dict(manager.parts.model, manager.parts.optimizer, tensors)
    manager.parts.scheduler.load_state_dict(state["scheduler"])
    _reapply_schedule(manager.parts.scheduler, manager.parts.optimizer)
    manager.parts.train_state.load_state_dict(state["progress"])
    manager.parts.load_named(state, path)
    step = int(state["step"])
    _restore_rng(manager, path, state, step)
    if manager.parts.loader is not None and state.get("data") is not None:
        manager.parts.loader.load_state_dict(state["data"])  # the data order continues exactly
    log.info("resumed from %s (step %d)", path, step)
    return Restored(kind="resume", path=path, step=step, metrics_run_ids=metrics_run_ids(state))


def _reapply_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer) -> None:
    """Set each group's LR from the rebuilt schedule at the restored step.

    The optimizer state carries the LR the old schedule chose; recomputing it
    (``base_lr * lambda(step)``, exactly what LambdaLR does) gives the same value when
    nothing changed and applies a changed ``train.max_steps`` from the first resumed step.
    """
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        return
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, lambdas, strict=True):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _restore_rng(manager: CheckpointedState, path: Path, state: dict[str, Any], step: int) -> None:
    """Each rank's own generators; a file refused on any rank stops every rank (no rank waits forever)."""
    groups = manager.groups
    found, error = None, None
    if state.get("world_size") == groups.world_size:
        try:
            found = read_rank_state(path, groups.rank)
        except KforgeError as exc:
            error = exc
    if not groups.all_true(error is None):
        raise error or UnsafeCheckpointError(f"another rank refused its train state in {path} (see its log)")
    if found is not None:
        restore_rng(*found)
        return
    saved, now = state.get("world_size"), groups.world_size
    why = f"saved at world size {saved}, now {now}" if saved != now else f"no RNG state for rank {groups.rank}"
    log.warning("checkpoint %s: %s, so RNGs are re-seeded from train.seed + step", path, why)
    seed_everything(manager.settings.train.seed + step)
