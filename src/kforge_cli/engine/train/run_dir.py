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
from kforge_cli.settings.shrink import POLICY, LayoutChoice

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


def write_config(settings: JobSettings, run_dir: Path, *, choice: LayoutChoice | None = None) -> Path:
    """RUN_DIR/config.toml on a new run; on a continued one, the accepted changes beside it.

    Call it once the run was accepted (after the checkpoint was restored): config.toml is
    written once, when the run starts, and a continuation's changes (e.g. train.max_steps) go
    to RUN_DIR/config_changes.jsonl (see `kforge_cli.rundir.saved_config`). A Hugging Face
    tokenizer of the training data is copied alongside (RUN_DIR/tokenizer.json) so
    `kforge generate` and `kforge eval` still find it if the data directory goes away.
    With the shrink policy's `choice` (slurm.min_nodes) the run's own settings are what is
    written or compared, never the layout re-planned for this job (see :func:`record_launch`).
    """
    run = RunDir(run_dir)
    continued = run.has_config()
    changes = write_or_record(choice.configured if choice is not None else settings, run.path)
    record_run_tokenizer(settings.data, run.path)
    if changes:
        log.info(
            "continuing %s with changed settings (recorded in %s): %s",
            run.path,
            run.config_changes.name,
            describe_changes(changes),
        )
    record_launch(settings, run.path, continued=continued, choice=choice)
    return run.config


def record_launch(settings: JobSettings, run_dir: Path, *, continued: bool, choice: LayoutChoice | None = None) -> None:
    """RUN_DIR/launch.json for this job; a continued run whose mesh changed gets a WARNING and a
    record in config_changes.jsonl (the checkpoint is resharded onto the new mesh on load).

    A change typed on the command line is reported as typed. One the shrink policy chose
    (`choice`, slurm.min_nodes) is reported with its reason and the gradient accumulation that
    keeps the global batch; on a new run that starts shrunk, the change is from the configured
    full-size layout.
    """
    launch = launch_of_env()
    world = launch["world_size"]
    assert isinstance(world, int)
    mesh = mesh_of(settings, world)
    accum = settings.train.grad_accum_steps
    previous = (read_launch(run_dir) if continued else None) or {}
    old_mesh, old_world, old_accum = previous.get("mesh"), previous.get("world_size"), previous.get("grad_accum_steps")
    if choice is not None and not isinstance(old_mesh, dict):  # a new run: from its configured layout
        old_mesh, old_world = mesh_of(choice.configured, choice.full_world_size), choice.full_world_size
    if choice is not None and not isinstance(old_accum, int):
        old_accum = choice.configured.train.grad_accum_steps
    moved = isinstance(old_mesh, dict) and old_mesh != mesh
    if isinstance(old_mesh, dict) and (moved or (choice is not None and old_accum != accum)):
        old, new = describe_mesh(old_mesh, old_world), describe_mesh(mesh, world)
        if choice is None:
            why = "as typed"
        else:
            old, new = f"{old}, grad_accum_steps {old_accum}", f"{new}, grad_accum_steps {accum}"
            why = f"chosen by the shrink policy: {choice.reason}"
        log.warning(
            "%s %s on another device mesh: %s -> %s (%s%s; recorded in %s)",
            "continuing" if previous else "starting",
            run_dir,
            old,
            new,
            why,
            "; the checkpoint is resharded on load" if previous else "",
            RunDir(run_dir).config_changes.name,
        )
        policy = {"policy": POLICY, "reason": choice.reason} if choice is not None else {}
        record_layout_change(run_dir, old, new, **policy)
    elif choice is not None and choice.shrunk:  # as the last job: said again, recorded once
        log.warning("%s runs re-planned, as its last job did: %s", run_dir, choice.reason)
    write_launch(run_dir, {**launch, "mesh": mesh, "grad_accum_steps": accum})


def mesh_of(settings: JobSettings, world_size: int) -> dict[str, int]:
    dims = resolve_dims(settings, world_size)
    return {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp}


def describe_mesh(mesh: Mapping[str, object], world_size: object) -> str:
    """`4 processes (dp_shard=2, tp=2)`: the world size and the dimensions above 1."""
    dims = ", ".join(f"{k}={v}" for k, v in mesh.items() if v != 1) or "no parallelism"
    count = f"{world_size} process{'' if world_size == 1 else 'es'}"
    return f"{count} ({dims})"
