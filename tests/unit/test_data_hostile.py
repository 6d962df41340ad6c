"""Crafted prepared-data directories: shard names stay inside, token ids are range-checked, schemas checked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kforge_cli.engine.data.prepare.prepare_run import prepare_data
from kforge_cli.engine.data.shards import load_prepared
from kforge_cli.errors import InvalidInputError


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    src = tmp_path / "in.txt"
    src.write_text("hello world\n" * 50)
    prepare_data([src], tmp_path / "data", val_fraction=0.0, workers=1)
    return tmp_path / "data"


def _meta(d: Path) -> dict:
    return json.loads((d / "metadata.json").read_text())


def _write_meta(d: Path, meta: dict) -> None:
    (d / "metadata.json").write_text(json.dumps(meta))


def test_prepare_caches_each_shards_max_token_id(prepared: Path) -> None:
    shard = _meta(prepared)["splits"]["train"]["shards"][0]
    assert shard["max_id"] == int(np.load(prepared / shard["file"]).max()) == 256  # the EOS id
    assert load_prepared(prepared).splits["train"][0].max_id == 256


@pytest.mark.parametrize("name", ["/etc/passwd", "../other/train_00000.npy", "sub/x.npy", ""])
def test_shard_names_must_be_plain_names_inside_the_directory(prepared: Path, name: str) -> None:
    meta = _meta(prepared)
    meta["splits"]["train"]["shards"][0]["file"] = name
    _write_meta(prepared, meta)
    with pytest.raises(InvalidInputError, match="plain file names inside the directory") as err:
        load_prepared(prepared)
    assert err.value.exit_code == 2


@pytest.mark.parametrize("cached", [True, False], ids=["cached-max", "scanned"])
def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_shard(prepared: Path, cached: bool) -> None:
    meta = _meta(prepared)
    entry = meta["splits"]["train"]["shards"][0]
    tokens = np.load(prepared / entry["file"])
    tokens[3] = 300  # vocabulary is 257 ids
    np.save(prepared / entry["file"], tokens)
    if cached:
        entry["max_id"] = 300
    else:
        del entry["max_id"]  # a directory from before the cache: scanned when opened
    _write_meta(prepared, meta)
    with pytest.raises(InvalidInputError, match=rf"shard {entry['file']} holds token id 300, outside .* 257 ids"):
        load_prepared(prepared)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(splits=[1]),
        lambda m: m.update(splits={"train": [1]}),
        lambda m: m["splits"]["train"].update(shards=[1]),
        lambda m: m["splits"]["train"]["shards"][0].update(tokens="many"),
        lambda m: m.update(tokenizer=None),
    ],
    ids=["splits-list", "split-list", "shard-int", "tokens-str", "tokenizer-none"],
)
def test_malformed_metadata_is_a_clear_error(prepared: Path, edit: object) -> None:
    meta = _meta(prepared)
    edit(meta)  # type: ignore[operator]
    _write_meta(prepared, meta)
    with pytest.raises(InvalidInputError, match="prepared data directory") as err:
        load_prepared(prepared)
    assert err.value.exit_code == 2


def test_out_replaces_only_prepare_datas_own_directories(tmp_path: Path, prepared: Path) -> None:
    src = tmp_path / "in.txt"
    ckpt = tmp_path / "step_10"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text(json.dumps({"format": "kforge-checkpoint", "step": 10}))
    (ckpt / ".metadata").write_bytes(b"precious")
    with pytest.raises(InvalidInputError, match="not written by `kforge prepare-data`"):
        prepare_data([src], ckpt, workers=1)
    assert (ckpt / ".metadata").read_bytes() == b"precious"
    a_file = tmp_path / "out.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(InvalidInputError, match="is a file, not a directory"):
        prepare_data([src], a_file, workers=1)
    with pytest.raises(InvalidInputError, match="holds data prepared from other inputs or options"):
        prepare_data([src], prepared, val_fraction=0.5, workers=1)  # other data there: not without --overwrite
    prepare_data([src], prepared, val_fraction=0.5, workers=1, overwrite=True)  # its own output: replaced
    assert _meta(prepared)["options"]["val_fraction"] == 0.5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".data.tmp")]


def test_lone_surrogates_and_deep_nesting_are_bad_records(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    good = json.dumps({"text": "fine"})
    src.write_text("\n".join([good, '{"text": "\\ud800"}', "[" * 200_000 + "]" * 200_000, good]) + "\n")
    with pytest.raises(InvalidInputError, match=r"in\.jsonl line 2: field 'text' holds a lone surrogate"):
        prepare_data([src], tmp_path / "a", workers=1)
    res = prepare_data([src], tmp_path / "b", workers=1, val_fraction=0.0, skip_bad_records=True)
    assert res.skipped_records == 2
    meta = _meta(tmp_path / "b")
    assert any("line 3: JSON nested too deeply" in e for e in meta["skipped_examples"])
    assert meta["splits"]["train"]["documents"] == 2


def test_a_fifo_metadata_json_is_refused_never_read(prepared: Path) -> None:
    """A planted FIFO would block every reader of the data directory forever (loader, validate-config,
    the start banner, plot --bits-per-byte): each refuses it, naming the file."""
    import os

    from kforge_cli.engine.evaluation.bits_per_byte import _prepared
    from kforge_cli.settings import load_settings
    from kforge_cli.settings.data_check import data_issues

    (prepared / "metadata.json").unlink()
    os.mkfifo(prepared / "metadata.json")
    with pytest.raises(InvalidInputError, match="metadata.json"):
        load_prepared(prepared)
    with pytest.raises(InvalidInputError, match="cannot read"):
        _prepared(str(prepared), prepared, "data.path")
    s = load_settings(overrides=[f"--data.path={prepared}"], use_env=False).settings
    (issue,) = data_issues(s)
    assert issue.path == "data.path" and "not a regular file" in issue.message, issue
