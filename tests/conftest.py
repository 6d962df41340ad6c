"""Shared test fixtures: paths and the kforge command (no test needs a file outside the repository)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.launch import REPO, kforge_cmd, run_kforge

__all__ = ["REPO", "kforge_cmd", "run_kforge"]


@pytest.fixture
def kforge():
    return run_kforge


@pytest.fixture(scope="session")
def data_stub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared-data directory holding only a byte-tokenizer metadata.json.

    Enough for the data checks of `validate-config` (which read only metadata.json), e.g.
    to validate a GPU profile, which refuses to run on the built-in demo corpus.
    """
    import json

    root = tmp_path_factory.mktemp("data_stub")
    meta = {"format": "kforge-tokens", "format_version": 1, "vocab_size": 257, "eos_id": 256}
    meta["tokenizer"] = {"kind": "byte", "vocab_size": 257, "eos_id": 256}
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker); run on a GPU machine")
    for item in items:
        # The marker itself, not `"gpu" in item.keywords`: keywords also hold node names (a module
        # test_bench_gpu.py, a checkout in a folder called gpu), which would skip CPU tests.
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(skip_gpu)
