"""The run directory of a training run: claimed by rank 0 (:mod:`kforge_cli.rundir.claim`), broadcast; its config written once."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from kforge_cli.engine.data.run_tokenizer import record_run_tokenizer
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.claim import claim_run_dir, forget_claim
from kforge_cli.rundir.launch import launch_of_env, read_launch, write_launch
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.saved_config import describe_changes, record_layout_change, write_or_record
from kforge_cli.settings import JobSettings, resolve_dims

log = logging.getLogger("kforge")


def resolve_run_dir(settings: JobSettings, runtime: RuntimeContext) -> Path:
    """RUN_DIR (absolute): train.run_dir, or a fresh default one; rank 0 decides, creates and locks it.

    A refusal on rank 0 (a file, a foreign directory, a run in progress) is broadcast so
    every rank raises it instead of waiting. Release the lock with :func:`kforge_cli.rundir.claim.release_run_dir`.
    """
    forget_claim()
    chosen: list[str | None] = [None, None]  # (run dir, error)
    if runtime.is_main:
        try:
            chosen[0] = str(claim_run_dir(settings))
        except InvalidInputError as exc:
            chosen[1] = str(exc)
    if runtime.distributed:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[1] is not None:
        raise InvalidInputError(chosen[1])
    assert chosen[0] is not None
    return Path(chosen[0])


def write_config(settings: JobSettings, run_dir: Path) -> Path:
    """RUN_DIR/config.toml on a new run; on a continued one, the accepted changes beside it.

    Call it once the run was accepted (after the checkpoint was restored): config.toml is
    written once, when the run starts, and a continuation's changes (e.g. train.max_steps) go
    to RUN_DIR/config_changes.jsonl (see `kforge_cli.rundir.saved_config`). A Hugging Face
    tokenizer of the training data is copied alongside (RUN_DIR/tokenizer.json) so
    `kforge generate` and `kforge eval` still find it if the data directory goes away.
    """
    run = RunDir(run_dir)
    continued = run.has_config()
    changes = write_or_record(settings, run.path)
    record_run_tokenizer(settings.data, run.path)
    if changes:
        log.info(
            "continuing %s with changed settings (recorded in %s): %s",
            run.path,
            run.config_changes.name,
            describe_changes(changes),
        )
    record_launch(settings, run.path, continued=continued)
    return run.config


def record_launch(settings: JobSettings, run_dir: Path, *, continued: bool) -> None:
    """RUN_DIR/launch.json for this job; a continued run whose mesh changed gets a WARNING and a
    record in config_changes.jsonl (the checkpoint is resharded onto the new mesh on load)."""
    launch = launch_of_env()
    world = launch["world_size"]
    assert isinstance(world, int)
    mesh = mesh_of(settings, world)
    previous = (read_launch(run_dir) if continued else None) or {}
    old_mesh = previous.get("mesh")
    if isinstance(old_mesh, dict) and old_mesh != mesh:
        old, new = describe_mesh(old_mesh, previous.get("world_size")), describe_mesh(mesh, world)
        log.warning(
            "continuing %s on another device mesh: %s -> %s (as typed; the checkpoint is resharded on load; "
            "recorded in %s)",
            run_dir,
            old,
            new,
            RunDir(run_dir).config_changes.name,
        )
        record_layout_change(run_dir, old, new)
    write_launch(run_dir, {**launch, "mesh": mesh})


def mesh_of(settings: JobSettings, world_size: int) -> dict[str, int]:
    dims = resolve_dims(settings, world_size)
    return {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp}


def describe_mesh(mesh: Mapping[str, object], world_size: object) -> str:
    """`4 processes (dp_shard=2, tp=2)`: the world size and the dimensions above 1."""
    dims = ", ".join(f"{k}={v}" for k, v in mesh.items() if v != 1) or "no parallelism"
    count = f"{world_size} process{'' if world_size == 1 else 'es'}"
    return f"{count} ({dims})"
