"""The `slurm_cluster` fixture: one real one-node SLURM per test session (installed if missing)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import LocalSlurm, install_reason, job_id_with_free_port


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurm]:
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="kforge-slurm-"))
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_three_nodes() -> Iterator[LocalSlurm]:
    """Three SLURM nodes n1, n2, n3 on this host (one `slurmd -N` each): a 2-node job can leave one behind."""
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="kforge-slurm3-"))
    cluster = LocalSlurm(root, node_names=("n1", "n2", "n3"), first_job_id=job_id_with_free_port())
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
