"""What a starting run loads: decided by rank 0 (shared filesystems disagree) and broadcast.

Order: the run's own newest complete checkpoint (auto-resume; a newer incomplete or damaged
one -- a shard shorter than its metadata, an unreadable train state -- is skipped with a
warning), else ``checkpoint.load_path`` (full resume from elsewhere),
else ``checkpoint.init_from`` (weights only). A checkpoint the run saved after starting
from ``load_path`` records it, so a requeued job continues from its own progress while
a changed ``load_path`` (a rollback) is honoured. ``resume = "never"`` in a checkpoint root
that already holds complete checkpoints is refused (exit 2).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from kforge_cli.engine.checkpoint.train_state import FORMAT
from kforge_cli.engine.checkpoint.verify import damage
from kforge_cli.engine.model.vlm.freeze import freeze_mismatch
from kforge_cli.rundir.checkpoints import (
    dcp_dirs,
    is_complete,
    is_hf_dir,
    list_step_dirs,
    read_json,
    read_latest,
    resolve_checkpoint,
)
from kforge_cli.rundir.fingerprint import changed_fields
from kforge_cli.rundir.names import TRAIN_STATE_FILE
from kforge_cli.settings import JobSettings
from kforge_cli.settings.infrastructure import CheckpointSettings

log = logging.getLogger("kforge")

RestoreKind = Literal["resume", "warm_start", "warm_start_hf"]


class Stateful(Protocol):
    """Anything whose state a checkpoint carries as JSON (the train state, the data loader)."""

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RestoreDecision:
    """What this run loads, decided on rank 0. ``kind`` None: a fresh start."""

    kind: RestoreKind | None = None
    path: Path | None = None
    dirs: list[Path] = field(default_factory=list)  # DCP directories (one per pipeline stage)
    train_state: dict[str, Any] = field(default_factory=dict)  # the checkpoint's train_state.json (resume)
    error: str | None = None  # rank 0 refused: every rank raises this
    unsafe: bool = False  # ... as an UnsafeCheckpointError

    def raise_error(self) -> None:
        if self.error is not None:
            raise (UnsafeCheckpointError if self.unsafe else CheckpointError)(self.error)


def _own_checkpoint(root: Path, load_path: str | None) -> tuple[Path, dict[str, object]] | None:
    """Newest complete checkpoint under `root` that belongs to this lineage (same load_path)."""
    for _, path in reversed(list_step_dirs(root)):
        if not is_complete(path):
            log.warning("skipping incomplete checkpoint %s (its save never finished); using an earlier one", path)
            continue
        problem = damage(path)
        if problem:
            log.warning("skipping damaged checkpoint %s (%s); using an earlier one", path, problem)
            continue
        state = read_json(path / TRAIN_STATE_FILE)
        if state.get("load_path") == load_path:
            return path, state
        log.info("not resuming from %s: it was saved before checkpoint.load_path changed", path)
    return None


def _refuse_older_checkpoints(root: Path) -> None:
    """``resume = "never"`` starts from scratch, so the checkpoint root must hold no earlier run's checkpoints.

    Mixing them would leave the new run unresumable: resume and retention pick by step
    number, and the saved config would describe the new model. Refused rather than guessed.
    """
    older = [p for _, p in list_step_dirs(root) if is_complete(p)]
    if older:
        raise CheckpointError(
            f"checkpoint.resume = 'never', but {root} already holds checkpoints of an earlier run "
            f"({', '.join(p.name for p in older[-3:])}); a fresh run there could not be resumed cleanly. "
            "Use a new --run-dir (or checkpoint.dir), remove those checkpoints, or resume with --checkpoint.resume=auto"
        )


def decide_restore(cfg: CheckpointSettings, root: Path) -> RestoreDecision:
    """What this run loads (rank 0 only): its own newest checkpoint, load_path, init_from, or nothing."""
    if cfg.resume == "never":
        _refuse_older_checkpoints(root)
    found = _own_checkpoint(root, cfg.load_path) if cfg.resume != "never" else None
    if found is None and cfg.load_path:
        path = resolve_checkpoint(cfg.load_path)
        problem = damage(path)
        if problem:
            raise CheckpointError(f"checkpoint.load_path {path} is damaged: {problem}")
        found = path, read_json(path / TRAIN_STATE_FILE)
    if found is not None:
        path, state = found
        latest = read_latest(root)
        if latest is not None and latest.resolve() != path.resolve() and path.parent.resolve() == root.resolve():
            log.warning("%s/latest names %s, but the newest complete checkpoint is %s", root, latest.name, path.name)
        return RestoreDecision(kind="resume", path=path, dirs=dcp_dirs(path), train_state=state)
    if cfg.resume == "require":
        raise CheckpointError(
            f"checkpoint.resume = 'require' but {root} holds no complete checkpoint; "
            "check the run directory, or set --checkpoint.resume=auto to start fresh"
        )
    if cfg.init_from:
        if is_hf_dir(cfg.init_from):  # a Hugging Face Llama directory (config.json + safetensors)
            return RestoreDecision(kind="warm_start_hf", path=Path(cfg.init_from).expanduser().resolve())
        path = resolve_checkpoint(cfg.init_from)
        return RestoreDecision(kind="warm_start", path=path, dirs=dcp_dirs(path))
    return RestoreDecision()


def freeze_config(settings: JobSettings) -> dict[str, object] | None:
    vlm = settings.vlm
    if vlm is None:
        return None
    return {"freeze": list(vlm.freeze), "freeze_schedule": [s.model_dump(mode="json") for s in vlm.freeze_schedule]}


def data_phase(settings: JobSettings, step: int) -> dict[str, int] | None:
    """The data phase in force at `step` (index in start order and its start), None before the first."""
    current = None
    for i, phase in enumerate(sorted(settings.data.phases, key=lambda p: p.start_step)):
        if phase.start_step <= step:
            current = {"index": i, "start_step": phase.start_step}
    return current


def check_compatible(
    state: dict[str, Any], path: Path, fingerprint: str, shaping: dict[str, object], settings: JobSettings
) -> None:
    """Refuse to resume a checkpoint of another model shape or (VLM) another freeze plan."""
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path / TRAIN_STATE_FILE} has format {state.get('format')!r}, expected {FORMAT}")
    if state.get("fingerprint") != fingerprint:
        changes = changed_fields(state.get("shaping") or {}, shaping) or ["(fields unknown: fingerprint differs)"]
        raise CheckpointError(
            f"cannot resume from {path}: it was saved for a differently shaped model ("
            + "; ".join(changes)
            + "). Continue with the run's own settings (`kforge resume RUN_DIR` uses its config.toml), or start a "
            f"new run directory from these weights with --checkpoint.init_from={path}"
        )
    if settings.vlm is not None and not settings.vlm.allow_freeze_mismatch:
        problem = freeze_mismatch(state.get("freeze"), settings.vlm, int(state.get("step", 0)))
        if problem:
            raise CheckpointError(
                f"cannot resume from {path}: {problem}. Restore vlm.freeze / vlm.freeze_schedule as they were "
                f"({state.get('freeze')}), or set --vlm.allow_freeze_mismatch=true to resume anyway"
            )
