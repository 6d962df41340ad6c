"""Crafted and damaged checkpoints: metadata is data (paths, offsets, sizes checked), damage falls back.

Every hostile file here is written by the test: a ``.metadata`` naming files outside the
checkpoint or beyond their end, shapes its bytes cannot back, malformed objects, a
commit marker pointing elsewhere, a `latest` that is not text, and committed checkpoints
with a truncated shard / RNG file or a train state missing a key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kforge_cli.cli.app import main
from kforge_cli.engine.checkpoint import CheckpointError, read_dcp_metadata
from kforge_cli.engine.checkpoint.reader import open_checkpoint, read_tensors
from kforge_cli.engine.checkpoint.verify import verify_checkpoint
from kforge_cli.rundir.checkpoints import dcp_dirs, list_step_dirs, prune, read_latest
from tests.unit.test_checkpoint_manager import make_run, train

KEY = "model.tok_embeddings.weight"


def saved(run_dir: Path, steps: tuple[int, ...] = (1,)) -> list[Path]:
    run = make_run(run_dir)
    run.manager.restore()
    out = []
    for step in steps:
        train(run, 1)
        out.append(run.manager.save(step))
    return out


def rewrite_metadata(step_dir: Path, edit: Any, source: Path | None = None) -> None:
    """Unpickle the honest .metadata (of `source`), let `edit` change it, pickle it into `step_dir`."""
    md = read_dcp_metadata(source or step_dir)
    edit(md)
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))


def set_storage(md: Any, fqn: str, **changes: Any) -> None:
    for index, info in list(md.storage_data.items()):
        if index.fqn == fqn:
            md.storage_data[index] = dataclasses.replace(info, **changes)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kforge ARGS` in this process: (exit code, stderr); any exception but SystemExit is a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return int(exit_info.value.code or 0), capsys.readouterr().err


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved(tmp_path_factory.mktemp("honest") / "run")[0]


def copy_of(step_dir: Path, dest: Path) -> Path:
    return Path(shutil.copytree(step_dir, dest / "run" / "checkpoints" / step_dir.name))


def test_storage_path_outside_the_checkpoint_is_refused(
    honest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = copy_of(honest, tmp_path / "other")
    victim = copy_of(honest, tmp_path / "victim")
    shard = next(p.name for p in victim.iterdir() if p.suffix == ".distcp")
    (victim / shard).unlink()  # every read must then come from the other run, as the crafted paths say
    for bad in (f"../../../other/run/checkpoints/{other.name}/{shard}", str(other / shard)):
        rewrite_metadata(victim, lambda md, bad=bad: [set_storage(md, f, relative_path=bad) for f in _fqns(md)], other)
        with pytest.raises(CheckpointError, match=r"only name plain files inside its own directory"):
            read_dcp_metadata(victim)
        assert not verify_checkpoint(victim).ok
        code, err = cli(capsys, "inspect-ckpt", str(victim), "--tensor", KEY)
        assert code == 2 and "plain files" in err and "Traceback" not in err


def _fqns(md: Any) -> set[str]:
    return {index.fqn for index in md.storage_data}


def test_link_to_dev_zero_and_ranges_beyond_the_file_are_refused_before_reading(honest: Path, tmp_path: Path) -> None:
    step = copy_of(honest, tmp_path)
    os.symlink("/dev/zero", step / "zero")
    rewrite_metadata(step, lambda md: set_storage(md, KEY, relative_path="zero", offset=0, length=1_500_000_000))
    with pytest.raises(CheckpointError, match=r"zero is a link to /dev/zero, outside the checkpoint"):
        read_tensors(open_checkpoint(step), [KEY])
    report = verify_checkpoint(step)
    assert any("outside the checkpoint" in p for p in report.problems) and report.tensors_read == 0
    step2 = copy_of(honest, tmp_path / "b")
    shard = next(p for p in step2.iterdir() if p.suffix == ".distcp")
    size = shard.stat().st_size
    length = next(info.length for i, info in read_dcp_metadata(step2).storage_data.items() if i.fqn == KEY)
    rewrite_metadata(step2, lambda md: set_storage(md, KEY, offset=size - 10))
    with pytest.raises(CheckpointError, match=rf"truncated: {size} bytes, its metadata needs {size - 10 + length}"):
        read_tensors(open_checkpoint(step2), [KEY])


@pytest.mark.parametrize("size", [150_000_000, 2**40])
def test_declared_shape_must_be_backed_by_stored_bytes(
    honest: Path, tmp_path: Path, size: int, capsys: pytest.CaptureFixture[str]
) -> None:
    step = copy_of(honest, tmp_path)

    def grow(md: Any) -> None:
        item = md.state_dict_metadata[KEY]
        item.size = torch.Size([size])
        item.chunks[0].sizes = torch.Size([size])
        item.chunks[0].offsets = torch.Size([0])
        old = next(i for i in md.storage_data if i.fqn == KEY)
        md.storage_data[type(old)(KEY, [0])] = md.storage_data.pop(old)

    rewrite_metadata(step, grow)
    with pytest.raises(CheckpointError, match=rf"{KEY}.*declares \[{size}\].*cannot back"):
        open_checkpoint(step)
    for args in (["--tensor", KEY], ["--verify"], []):
        code, err = cli(capsys, "inspect-ckpt", str(step), *args)
        assert code == 2 and "cannot back" in err and "Traceback" not in err, (args, err)
    code, err = cli(capsys, "export-hf", str(step), str(tmp_path / "hf"))
    assert code == 2 and "cannot back" in err


@pytest.mark.parametrize(
    "edit",
    [
        lambda md: setattr(md.state_dict_metadata[KEY], "size", ["abc"]),
        lambda md: setattr(md.state_dict_metadata[KEY], "properties", None),
        lambda md: setattr(md, "state_dict_metadata", list(md.state_dict_metadata.items())),
        lambda md: setattr(md.state_dict_metadata[KEY], "chunks", None),
        lambda md: set_storage(md, KEY, offset=-5),
    ],
    ids=["size-str", "properties-none", "list-for-dict", "chunks-none", "negative-offset"],
)
def test_malformed_metadata_is_a_clear_error(
    honest: Path, tmp_path: Path, edit: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    step = copy_of(honest, tmp_path)
    rewrite_metadata(step, edit)
    for args in (["--tensor", KEY], ["--verify"], []):
        code, err = cli(capsys, "inspect-ckpt", str(step), *args)
        assert code == 2 and ".metadata" in err and "Traceback" not in err, (args, err)


def test_commit_marker_dcp_dirs_must_stay_inside(honest: Path, tmp_path: Path) -> None:
    other_run = saved(tmp_path / "other")[0]  # the run whose weights a crafted marker would resume
    step = copy_of(honest, tmp_path / "victim")
    for dirs, why in (
        ("pp_0", "not a non-empty list"),
        ([str(other_run)], "only '.' or pp_S"),
        ([f"../../../other/checkpoints/{other_run.name}"], "only '.' or pp_S"),
    ):
        (step / "kforge_commit.json").write_text(json.dumps({"step": 1, "dcp_dirs": dirs}))
        with pytest.raises(CheckpointError, match=why):
            dcp_dirs(step)
        run = make_run(tmp_path / "victim" / "run")
        assert run.manager.restore() is None  # not complete: not resumed, nothing else loaded


def test_latest_that_is_not_text_or_not_a_step_is_ignored(tmp_path: Path) -> None:
    saved(tmp_path, (1, 2))
    root = tmp_path / "checkpoints"
    for blob in (b"\xff\xfe\x00step", b"../../elsewhere\n", b"/etc\n"):
        (root / "latest").write_bytes(blob)
        assert read_latest(root) is None
        run = make_run(tmp_path)
        restored = run.manager.restore()
        assert restored is not None and restored.step == 2
    assert {p.name for _, p in list_step_dirs(root)} == {"step_1", "step_2"}


def _truncate_shard(step: Path) -> None:
    shard = next(p for p in step.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _truncate_rank_state(step: Path) -> None:
    pt = step / "train_state" / "rank_0.pt"
    pt.write_bytes(pt.read_bytes()[:100])


def _drop_train_state_key(step: Path) -> None:
    state = json.loads((step / "train_state.json").read_text())
    del state["scheduler"]
    (step / "train_state.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_truncate_shard, "is truncated"),
        (_truncate_rank_state, r"rank_0\.pt is not readable"),
        (_drop_train_state_key, r"'scheduler' is missing"),
    ],
    ids=["shard", "rank-state", "train-state-key"],
)
def test_damaged_committed_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, damage: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    _, newest = saved(tmp_path, (1, 2))
    damage(newest)
    run = make_run(tmp_path)
    restored = run.manager.restore()
    assert restored is not None and restored.step == 1 and run.state.step == 1
    assert "skipping damaged checkpoint" in caplog.text and "step_2" in caplog.text
    assert any(m for m in caplog.messages if "step_2" in m and re.search(why, m)), caplog.messages
    assert not verify_checkpoint(newest).ok


def test_symlinked_step_dir_is_never_followed(tmp_path: Path) -> None:
    target = saved(tmp_path / "precious", (1,))[0]
    saved(tmp_path / "run", (1, 2, 3))
    root = tmp_path / "run" / "checkpoints"
    os.symlink(target, root / "step_0")
    assert [s for s, _ in list_step_dirs(root)] == [1, 2, 3]
    prune(root, keep_last_n=1, protect=set())
    assert {p.name for p in root.iterdir()} >= {"step_0", "step_3"} and not (root / "step_1").exists()
    assert (target / "kforge_commit.json").is_file() and verify_checkpoint(target).ok


def test_export_hf_overwrite_refuses_a_run_or_checkpoint_directory(
    honest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other_run = saved(tmp_path / "other")[0].parent.parent
    code, err = cli(capsys, "export-hf", str(honest), str(other_run), "--overwrite")
    assert code == 2 and "refusing to overwrite" in err and (other_run / "checkpoints").is_dir()
    code, err = cli(capsys, "export-hf", str(honest), str(honest.parent.parent), "--overwrite")
    assert code == 2 and "holds the checkpoint being exported" in err and honest.is_dir()
    a_file = tmp_path / "out.bin"
    a_file.write_bytes(b"x")
    code, err = cli(capsys, "export-hf", str(honest), str(a_file))
    assert code == 2 and "is a file" in err
    code, _ = cli(capsys, "export-hf", str(honest), str(tmp_path / "hf"))
    assert code == 0
    code, _ = cli(capsys, "export-hf", str(honest), str(tmp_path / "hf"), "--overwrite")  # an earlier export
    assert code == 0 and (tmp_path / "hf" / "config.json").is_file()


def test_a_full_disk_during_save_says_so_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from kforge_cli.engine.checkpoint.disk_full import DiskFullError

    run = make_run(tmp_path)
    run.manager.restore()
    train(run, 1)
    first = run.manager.save(1)

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    train(run, 1)
    with pytest.raises(DiskFullError, match=r"disk full \(ENOSPC\) while saving checkpoint .*step_2.*step_1 is intact"):
        run.manager.save(2)
    monkeypatch.undo()
    assert read_latest(tmp_path / "checkpoints") == first and verify_checkpoint(first).ok
    resumed = make_run(tmp_path)
    restored = resumed.manager.restore()
    assert restored is not None and restored.step == 1


def test_convert_mot_to_an_existing_file_is_a_clear_error(
    honest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "out.bin"
    a_file.write_bytes(b"x")
    code, err = cli(capsys, "convert-mot", str(honest), str(a_file))
    assert code == 2 and "is a file, not a directory" in err and "Traceback" not in err, err
    assert a_file.read_bytes() == b"x"
