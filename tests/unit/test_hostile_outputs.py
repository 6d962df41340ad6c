"""Output directories: only a provable earlier output of the same command is replaced (issue 29, class 4).

`export-hf --overwrite` replaces OUT only when OUT holds export-hf's marker naming every
entry and nothing else (no directory, no link, nothing the user added); a symbolic link at
OUT is refused rather than resolved. `convert-mot` never removes a `.OUT.partial` it did
not create and never writes through a linked OUT.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from kforge_cli.engine.interop.hf_export import export_hf
from tests.unit.test_checkpoint_hostile import saved


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved(tmp_path_factory.mktemp("hf_src") / "run")[0]


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return int(exit_info.value.code or 0), capsys.readouterr().err


def _source_tree(d: Path) -> None:
    (d / "src").mkdir(parents=True)
    (d / "src" / "model.py").write_text("print('my code')\n")
    (d / "README.md").write_text("my project\n")


def _nested_run(d: Path) -> None:
    (d / "colleague" / "checkpoints" / "step_5").mkdir(parents=True)
    (d / "colleague" / "config.toml").write_text("[model]\n[train]\n")
    (d / "notes.txt").write_text("keep\n")


def _forged_top_level(d: Path) -> None:
    """Top-level names an export writes, but a directory among them: not what an export leaves."""
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").mkdir()
    (d / "model.safetensors" / "precious.bin").write_bytes(b"x")


@pytest.mark.parametrize("plant", [_source_tree, _nested_run, _forged_top_level], ids=["source", "run", "forged"])
def test_overwrite_refuses_what_is_not_an_earlier_export(
    ckpt: Path, tmp_path: Path, plant: object, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    plant(out)  # type: ignore[operator]
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    code, err = cli(capsys, "export-hf", str(ckpt), str(out), "--overwrite")
    assert code == 2 and "refusing to overwrite" in err and "Traceback" not in err, err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left behind


def test_a_symlinked_output_is_refused_not_resolved(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"  # e.g. a prepared data directory the link points at
    data.mkdir()
    (data / "train_00000.bin").write_bytes(b"\0" * 16)
    first = tmp_path / "hf_real"
    export_hf(ckpt, first)
    for target in (data, first):  # even a link to a genuine export: kforge never deletes through a link
        link = tmp_path / f"link_to_{target.name}"
        os.symlink(target, link)
        code, err = cli(capsys, "export-hf", str(ckpt), str(link), "--overwrite")
        assert code == 2 and "is a symbolic link" in err, err
        assert link.is_symlink() and target.is_dir()
    assert (data / "train_00000.bin").read_bytes() == b"\0" * 16


def test_an_earlier_export_is_replaced_but_not_once_the_user_added_to_it(ckpt: Path, tmp_path: Path) -> None:
    from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
    from kforge_cli.engine.interop.hf_export import EXPORT_MARKER

    out = tmp_path / "hf"
    export_hf(ckpt, out)
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert sorted(marker["files"]) == sorted(p.name for p in out.iterdir() if p.name != EXPORT_MARKER)
    export_hf(ckpt, out, overwrite=True)  # provably an earlier export: replaced
    (out / "model_card.md").write_text("my notes\n")
    with pytest.raises(CheckpointError, match=r"holds what the export did not write \(model_card\.md\)"):
        export_hf(ckpt, out, overwrite=True)
    assert (out / "model_card.md").read_text() == "my notes\n"


def test_convert_mot_keeps_a_partial_directory_it_did_not_create_and_refuses_a_linked_out(tmp_path: Path) -> None:
    from kforge_cli.engine.interop.mot_convert import convert_mot
    from kforge_cli.errors import KforgeError
    from tests.unit.test_vlm_convert import dense_checkpoint
    from tests.unit.test_vlm_model import vlm_settings

    dense, _ = dense_checkpoint(tmp_path)
    s = vlm_settings("--vlm.arch=mot")
    partial = tmp_path / ".mot.partial"  # someone else's (or an earlier run's) work in progress
    partial.mkdir()
    (partial / "theirs.txt").write_text("not yours\n")
    result = convert_mot(s, dense, tmp_path / "mot")
    assert (result.path / "train_state.json").is_file() or any(result.path.iterdir())
    assert (partial / "theirs.txt").read_text() == "not yours\n"
    assert not [p for p in tmp_path.iterdir() if ".mot.partial-" in p.name]  # its own temporary dir is gone
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    os.symlink(empty, tmp_path / "linked")
    with pytest.raises(KforgeError, match="is a symbolic link") as err:
        convert_mot(s, dense, tmp_path / "linked")
    assert err.value.exit_code == 2 and empty.is_dir() and not any(empty.iterdir())


def test_resume_sbatch_never_rewrites_a_live_runs_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Class 6: a refused command has changed nothing; `resume --sbatch` takes the run's lock first."""
    from kforge_cli.rundir.lock import acquire_run_lock
    from kforge_cli.settings import load_settings
    from kforge_cli.settings.explain import to_toml

    run = tmp_path / "live"
    run.mkdir()
    settings = load_settings(overrides=[f"--train.run_dir={run}", "--model.dim=32"], use_env=False).settings
    (run / "config.toml").write_text(to_toml(settings))
    before = (run / "config.toml").read_bytes()
    args = ["resume", str(run), "--sbatch", "--checkpoint.resume=auto", "--train.max_steps=999"]
    with acquire_run_lock(run, wait_s=0):  # the training job holding it
        code, err = cli(capsys, *args)
        assert code == 2 and "in use by another kforge run" in err and "Traceback" not in err, err
        assert (run / "config.toml").read_bytes() == before and not (run / "job.sbatch").exists()
    code, err = cli(capsys, *args)  # once it has ended
    assert code == 0, err
    changes = (run / "config_changes.jsonl").read_text()  # config.toml is written once; the change beside it
    assert (
        f'"train.max_steps": {{"from": {settings.train.max_steps}, "to": 999}}' in changes
        and (run / "job.sbatch").is_file()
    )
    assert (run / "config.toml").read_bytes() == before
