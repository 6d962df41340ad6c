"""`python -m kforge_cli ...` (what `torchrun -m kforge_cli train ...` and job.sbatch run).

`python -m` puts the working directory first on ``sys.path``; a job started in someone
else's directory would then import a planted ``my_pkg/hooks.py`` (or anything shadowing a
library) from there. The entry is dropped unless ``$PYTHONPATH`` names that directory.
"""

import os
import sys


def _drop_working_directory() -> None:
    if not sys.path:
        return
    cwd = os.path.realpath(os.getcwd())
    explicit = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    first = sys.path[0]
    if (first in ("", ".") or os.path.realpath(first) == cwd) and cwd not in explicit:
        del sys.path[0]


_drop_working_directory()

from kforge_cli.cli.app import main  # noqa: E402

if __name__ == "__main__":
    main()
