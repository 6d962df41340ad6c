"""SLURM job scripts: `kforge train --sbatch [--submit]` and `kforge resume RUN_DIR --sbatch`.

Torch-free: generating a script works on a login node or a laptop without SLURM; only
`--submit` needs `sbatch`.
"""

from kforge_cli.slurm.job_setup import JobFiles, sbatch_from_cli, write_job
from kforge_cli.slurm.sbatch import parse_time_limit, render_sbatch, sbatch_directives, slurm_issues, train_command
from kforge_cli.slurm.submit import SbatchError, submit_script

__all__ = [
    "JobFiles",
    "SbatchError",
    "parse_time_limit",
    "render_sbatch",
    "sbatch_directives",
    "sbatch_from_cli",
    "slurm_issues",
    "submit_script",
    "train_command",
    "write_job",
]
