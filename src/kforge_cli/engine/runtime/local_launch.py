"""`kforge train --nproc-per-node N`: start N local training processes with torch's elastic launcher.

This is exactly what ``torchrun --standalone --nproc-per-node N -m kforge_cli train ...``
does (torch.distributed.run, a free rendezvous port, one process per rank), for users
without torchrun habits. The children run the same command without the flag and detect
the launch from torchrun's environment like any torchrun job.
"""

from __future__ import annotations

import logging
import os
import sys

from kforge_cli.errors import EXIT_FAILURE

log = logging.getLogger("kforge")


def threads_per_process(nproc: int, cpu_count: int | None) -> int:
    """CPU threads for each of ``nproc`` local processes: a fair share of the cores (at least 1)."""
    return max(1, (cpu_count or 1) // nproc)


def launch_local(nproc: int, child_args: list[str]) -> int:
    """Run ``python -m kforge_cli <child_args>`` in ``nproc`` processes; returns the job's exit code.

    The exit code is the first failed rank's (so 2 = invalid input, 75 = requeue
    survive the launcher), or 0 when every rank succeeded.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun would force 1 thread per process; a fair share is better for CPU training.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc, os.cpu_count())))
    argv = ["--standalone", f"--nproc-per-node={nproc}", "--module", "kforge_cli", *child_args]
    args = get_args_parser().parse_args(argv)
    sys.stdout.flush()
    try:
        run(args)
    except ChildFailedError as err:
        failures = sorted(err.failures.items())
        code = next((f.exitcode for _, f in failures if f.exitcode and f.exitcode > 0), EXIT_FAILURE)
        log.error("%d of %d processes failed (exit code %d)", len(failures), nproc, code)
        return code
    return 0
