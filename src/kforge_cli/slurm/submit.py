"""Submitting a job script with `sbatch`, with errors that show sbatch's own message and the script."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kforge_cli.errors import KforgeError

SUBMIT_TIMEOUT_S = 120


class SbatchError(KforgeError):
    """sbatch is missing or refused the script (exit 1); the generated script stays for inspection."""


def submit_script(script: Path, *, sbatch: str = "sbatch") -> str:
    """Submit `script`; return the job id that `sbatch --parsable` printed."""
    exe = shutil.which(sbatch)
    if exe is None:
        raise SbatchError(
            f"cannot submit: {sbatch!r} not found on PATH (not a SLURM login node?); "
            f"the script is {script}: submit it with `sbatch {script}` where SLURM is available"
        )
    try:
        proc = subprocess.run(
            [exe, "--parsable", str(script)], capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise SbatchError(f"sbatch did not answer within {SUBMIT_TIMEOUT_S} s; the script is {script}") from None
    except OSError as exc:
        raise SbatchError(f"cannot run {exe}: {exc.strerror}; the script is {script}") from None
    message = (proc.stderr.strip() or proc.stdout.strip() or "(no message)").replace("\n", "\n  ")
    if proc.returncode != 0:
        raise SbatchError(
            f"sbatch refused {script} (exit code {proc.returncode}):\n  {message}\n"
            "fix the slurm settings (e.g. --slurm.partition=NAME) and run again, or edit the script and submit it"
        )
    job_id = proc.stdout.strip().split(";")[0].strip()
    if not job_id:
        raise SbatchError(f"sbatch accepted {script} but printed no job id:\n  {message}")
    return job_id
