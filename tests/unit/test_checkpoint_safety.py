"""Hostile checkpoints: a pickle code payload in .metadata, train state or a DCP item is refused, never run."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kforge_cli.engine.checkpoint import UnsafeCheckpointError, read_dcp_metadata
from kforge_cli.engine.checkpoint.dcp_io import training_state_dict
from tests.unit.test_checkpoint_manager import make_run, train


class Payload:
    """Unpickling this runs `touch MARKER` (what an attacker's checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def saved_run(tmp_path: Path) -> Path:
    run = make_run(tmp_path / "victim")
    run.manager.restore()
    train(run, 1)
    return run.manager.save(1)


def test_real_metadata_is_readable(tmp_path: Path) -> None:
    step_dir = saved_run(tmp_path)
    md = read_dcp_metadata(step_dir)
    assert "model.tok_embeddings.weight" in md.state_dict_metadata
    assert tuple(md.state_dict_metadata["model.tok_embeddings.weight"].size) == (64, 32)  # type: ignore[union-attr]
    assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg_sq") for k in md.state_dict_metadata)


@pytest.mark.parametrize("nested", [False, True])
def test_metadata_payload_is_refused_by_resume_and_warm_start(tmp_path: Path, nested: bool) -> None:
    step_dir = saved_run(tmp_path)
    marker = tmp_path / "pwned"
    if nested:  # a real Metadata object with the payload tucked inside
        md = read_dcp_metadata(step_dir)
        md.planner_data = {"x": Payload(marker)}
        blob = pickle.dumps(md)
    else:
        blob = pickle.dumps(Payload(marker))
    (step_dir / ".metadata").write_bytes(blob)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*posix\.system|\.metadata.*os\.system") as err:
        read_dcp_metadata(step_dir)
    assert str(step_dir / ".metadata") in str(err.value)
    resume = make_run(tmp_path / "victim")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
        resume.manager.restore()
    warm = make_run(tmp_path / "fresh", [f"--checkpoint.init_from={step_dir}"])
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata") as err:
        warm.manager.restore()
    assert err.value.exit_code == 2
    assert not marker.exists()


def test_train_state_payload_is_refused(tmp_path: Path) -> None:
    step_dir = saved_run(tmp_path)
    marker = tmp_path / "pwned"
    rank_file = step_dir / "train_state" / "rank_0.pt"
    torch.save({"torch_cpu": Payload(marker)}, rank_file)
    run = make_run(tmp_path / "victim")
    with pytest.raises(UnsafeCheckpointError, match=r"rank_0\.pt.*could run code"):
        run.manager.restore()
    assert not marker.exists()


def test_dcp_byte_item_payload_is_refused(tmp_path: Path) -> None:
    step_dir = saved_run(tmp_path)
    marker = tmp_path / "pwned"
    run = make_run(tmp_path / "other")
    train(run, 1)
    state = training_state_dict(run.model, run.optimizer)
    key = next(k for k in state["optimizer"] if k.startswith("param_groups.") and k.endswith(".lr"))
    state["optimizer"][key] = Payload(marker)  # DCP stores non-tensors as pickled bytes
    dcp.save(state, checkpoint_id=step_dir, no_dist=True)
    victim = make_run(tmp_path / "victim")
    with pytest.raises(UnsafeCheckpointError, match=rf"{key}.*not plain data"):
        victim.manager.restore()
    assert not marker.exists()
