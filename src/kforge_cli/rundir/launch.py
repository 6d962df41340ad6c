"""How a run's jobs start and end: ``RUN_DIR/launch.json`` and ``RUN_DIR/exit.json``.

``launch.json`` is rewritten by rank 0 each time a job of the run is accepted (after its
checkpoint was restored): the launcher (``single``, ``local`` for ``kforge train
--nproc-per-node N``, ``torchrun``, ``srun``), the processes per node, the world size and the
device mesh. ``kforge resume RUN`` reads it to start the run the way it ran (the same
``--nproc-per-node``) and to say when a typed change moves the checkpoint onto another mesh.

``exit.json`` is how the last job ended: ``{"code": 75, "step": 23, "time": ...}``. The
job's lock holder removes it when it takes the run directory, and the command that ran the
job writes it when the job ends (rank 0, and the ``--nproc-per-node`` launcher with the
job's own code). A run whose lock is free and has no exit record was killed.
Imports no torch.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
from collections.abc import Mapping
from pathlib import Path

from kforge_cli.common.files import MAX_TOML_BYTES, atomic_write, read_text_capped
from kforge_cli.rundir.layout import RunDir

LOCAL_CHILD_ENV = "KFORGE_LOCAL_CHILD"  # set by `kforge train --nproc-per-node N` in each process it starts


def launch_of_env(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """Who started this process, from its environment: launcher, processes per node, world size."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        launcher = "local" if env.get(LOCAL_CHILD_ENV) == "1" else "torchrun"
        return {"launcher": launcher, "nproc_per_node": int(env.get("LOCAL_WORLD_SIZE") or world), "world_size": world}
    ntasks = int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1)
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and ntasks > 1:
        per_node = int((env.get("SLURM_NTASKS_PER_NODE") or str(ntasks)).split("(")[0] or ntasks)
        return {"launcher": "srun", "nproc_per_node": per_node, "world_size": ntasks}
    return {"launcher": "single", "nproc_per_node": 1, "world_size": 1}


def launched() -> bool:
    """This process is one rank of a job a launcher started (torchrun, srun, --nproc-per-node)."""
    return launch_of_env()["launcher"] != "single"


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        data: object = json.loads(read_text_capped(path, MAX_TOML_BYTES, path.name))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    except Exception:  # kforge's own refusal of a FIFO or an oversized file: no record
        return None
    return data if isinstance(data, dict) else None


def read_launch(run_dir: Path) -> dict[str, object] | None:
    """The run's launch record (None when there is none or it is unreadable)."""
    return _read_json(RunDir(run_dir).launch_file)


def write_launch(run_dir: Path, record: Mapping[str, object]) -> None:
    """Replace RUN_DIR/launch.json (atomically; rank 0, once the job was accepted)."""
    payload = {**record, "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
    atomic_write(RunDir(run_dir).launch_file, (json.dumps(payload, sort_keys=True) + "\n").encode())


def recorded_local_nproc(run_dir: Path) -> int | None:
    """N when the run's last job was started by `kforge train --nproc-per-node N` (N > 1), else None."""
    record = read_launch(run_dir) or {}
    nproc = record.get("nproc_per_node")
    if record.get("launcher") == "local" and isinstance(nproc, int) and nproc > 1:
        return nproc
    return None


def read_exit(run_dir: Path) -> dict[str, object] | None:
    """How the run's last job ended (None: it has not ended, or it was killed)."""
    return _read_json(RunDir(run_dir).exit_file)


def write_exit(run_dir: Path, code: int, step: int | None = None) -> None:
    """Record the job's exit code (and the step it reached) in RUN_DIR/exit.json."""
    record = {"code": int(code), "step": step, "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
    with contextlib.suppress(OSError):  # a record that cannot be written never changes the exit code
        atomic_write(RunDir(run_dir).exit_file, (json.dumps(record, sort_keys=True) + "\n").encode())


def clear_exit(run_dir: Path) -> None:
    """Forget the previous job's ending (the lock holder, when a job starts)."""
    with contextlib.suppress(FileNotFoundError):
        RunDir(run_dir).exit_file.unlink()
