"""The run directory: chosen by rank 0, broadcast, and stamped with the resolved config."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from kforge_cli.engine.checkpoint.run_config import conflicts_with_saved_config
from kforge_cli.engine.data.run_tokenizer import record_run_tokenizer
from kforge_cli.engine.runtime import RuntimeContext
from kforge_cli.settings import JobSettings
from kforge_cli.settings.explain import to_toml
from kforge_cli.settings.run_dir import default_run_dir

log = logging.getLogger("kforge")


def resolve_run_dir(settings: JobSettings, runtime: RuntimeContext) -> Path:
    """RUN_DIR (absolute): train.run_dir, or the default name decided by rank 0 for every rank."""
    chosen = [str(Path(settings.train.run_dir or default_run_dir(settings)).expanduser().resolve())]
    if runtime.distributed:
        dist.broadcast_object_list(chosen, src=0)
    run_dir = Path(chosen[0])
    if runtime.is_main:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if runtime.distributed:
        dist.barrier()
    return run_dir


def with_run_dir(settings: JobSettings, run_dir: Path) -> JobSettings:
    """A copy of ``settings`` that names ``run_dir`` (what the run's config.toml records)."""
    return settings.model_copy(update={"train": settings.train.model_copy(update={"run_dir": str(run_dir)})})


def write_config(settings: JobSettings, run_dir: Path) -> Path:
    """RUN_DIR/config.toml: the fully resolved settings (written atomically).

    On a resume the file takes the new settings, except when they change the model's
    shape while RUN_DIR holds a checkpoint: then the original stays (the resume is refused
    when the checkpoint is opened, and `kforge resume` still finds the run's real config).
    A Hugging Face tokenizer of the training data is copied alongside (RUN_DIR/tokenizer.json)
    so `kforge generate` and `kforge eval` still find it if the data directory goes away.
    """
    path = run_dir / "config.toml"
    record_run_tokenizer(settings.data, run_dir)
    conflicts = conflicts_with_saved_config(settings, run_dir)
    if conflicts:
        log.warning("keeping %s: these settings change the model's shape (%s)", path, "; ".join(conflicts))
        return path
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(to_toml(with_run_dir(settings, run_dir)))
    tmp.replace(path)
    return path
