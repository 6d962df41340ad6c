"""The `slurm_cluster` fixture: one real one-node SLURM per test session (installed if missing)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import LocalSlurm, install_reason


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
