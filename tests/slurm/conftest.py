"""The `slurm_cluster` fixture: one real one-node SLURM per test session (installed if missing)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import LocalSlurm, install_reason, job_id_with_free_port


def _running(prefix: str, node_names: tuple[str, ...] = (), first_job_id: int = 1) -> Iterator[LocalSlurm]:
    """A started cluster in a fresh directory, stopped and removed after (skips when SLURM is missing)."""
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    cluster = LocalSlurm(root, node_names=node_names, first_job_id=first_job_id)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurm]:
    yield from _running("kforge-slurm-")


@pytest.fixture(scope="module")
def slurm_three_nodes() -> Iterator[LocalSlurm]:
    """Three SLURM nodes n1, n2, n3 on this host (one `slurmd -N` each): a 2-node job can leave one behind."""
    yield from _running("kforge-slurm3-", node_names=("n1", "n2", "n3"), first_job_id=job_id_with_free_port())
