"""prepare-data: token content, metadata, splits, idempotence, atomic output, and every bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kforge_cli.engine.data.builtin_corpus import generate_documents
from kforge_cli.engine.data.prepare import inputs as inputs_mod
from kforge_cli.engine.data.prepare.prepare_run import prepare_data
from kforge_cli.engine.data.shards import load_prepared
from kforge_cli.errors import InvalidInputError

EOS = 256


def _tokens(out: Path, split: str) -> np.ndarray:
    meta = load_prepared(out)
    parts = [np.load(s.path) for s in meta.splits.get(split, [])]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)


def _docs(tokens: np.ndarray) -> list[bytes]:
    cuts = np.flatnonzero(tokens == EOS)
    assert len(cuts) and cuts[-1] == len(tokens) - 1  # every document ends with EOS
    return [
        tokens[a + 1 if i else 0 : b].astype(np.uint8).tobytes()
        for i, (a, b) in enumerate(zip(np.r_[-1, cuts[:-1]], cuts, strict=True))
    ]


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)  # type: ignore[operator]
    return path


def test_text_files_become_byte_tokens_with_eos_and_metadata(tmp_path: Path) -> None:
    src = tmp_path / "in"
    _write(src / "b.txt", "second file\n")
    _write(src / "a.txt", "héllo\nworld\n")
    _write(src / ".hidden", "not read")
    res = prepare_data([src], tmp_path / "out", val_fraction=0.0, workers=1)
    train = _tokens(tmp_path / "out", "train")
    assert train.dtype == np.uint16  # 257 ids do not fit uint8
    assert _docs(train) == ["héllo\nworld\n".encode(), b"second file\n"]  # sorted order, one doc per file
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (257, 256, "uint16")
    assert meta["splits"]["train"]["tokens"] == len(train) == res.tokens["train"] == 13 + 12 + 2
    assert meta["splits"]["train"]["documents"] == 2 and meta["splits"]["val"]["tokens"] == 0
    a = (src / "a.txt").read_bytes()
    assert meta["sources"][0] == {
        "path": str((src / "a.txt").resolve()),
        "kind": "text",
        "bytes": len(a),
        "sha256": hashlib.sha256(a).hexdigest(),
    }
    assert not list(tmp_path.glob(".out.*"))  # no temporary directory left behind


def test_jsonl_records_are_documents(tmp_path: Path) -> None:
    lines = ['{"text": "one"}', "", '{"text": "two", "id": 2}', '{"text": ""}', '{"body": "x", "text": "three"}']
    f = _write(tmp_path / "d.jsonl", "\n".join(lines) + "\n")
    res = prepare_data([f], tmp_path / "out", val_fraction=0.0, workers=1)
    assert _docs(_tokens(tmp_path / "out", "train")) == [b"one", b"two", b"three"]
    assert res.documents["train"] == 3
    other = _write(tmp_path / "e.jsonl", '{"body": "four"}\n')
    prepare_data([other], tmp_path / "out2", val_fraction=0.0, text_field="body", workers=1)
    assert _docs(_tokens(tmp_path / "out2", "train")) == [b"four"]


def test_val_split_is_whole_lines_and_nothing_is_lost(tmp_path: Path) -> None:
    text = "".join(generate_documents(300))  # ~100 KB: 25 segments of 4 KiB
    f = _write(tmp_path / "t.txt", text)
    res = prepare_data([f], tmp_path / "out", val_fraction=0.1, workers=1)
    train, val = _tokens(tmp_path / "out", "train"), _tokens(tmp_path / "out", "val")
    assert res.tokens["val"] > 0 and 0.05 < res.tokens["val"] / len(text.encode()) < 0.2
    assert int((train != EOS).sum() + (val != EOS).sum()) == len(text.encode())
    raw = text.encode()
    for doc in _docs(train) + _docs(val):  # each piece is a run of whole lines of the file
        at = raw.find(doc)
        assert at >= 0 and (at == 0 or raw[at - 1 : at] == b"\n") and doc.endswith(b"\n")


def test_worker_processes_give_identical_shards(tmp_path: Path) -> None:
    text = "".join(generate_documents(200))
    files = [_write(tmp_path / "in" / f"{i}.txt", text[i * 1000 :]) for i in range(3)]
    prepare_data(files, tmp_path / "one", val_fraction=0.05, workers=1)
    res = prepare_data(files, tmp_path / "two", val_fraction=0.05, workers=2, shard_tokens=10_000)
    assert res.workers == 2
    assert len(load_prepared(tmp_path / "two").splits["train"]) > 1  # several shards
    for split in ("train", "val"):
        assert np.array_equal(_tokens(tmp_path / "one", split), _tokens(tmp_path / "two", split))


def test_rerun_is_a_no_op_and_a_changed_input_rebuilds(tmp_path: Path) -> None:
    f = _write(tmp_path / "t.txt", "abc\n")
    out = tmp_path / "out"
    assert not prepare_data([f], out, workers=1).reused
    stamp = (out / "metadata.json").stat().st_mtime_ns
    again = prepare_data([f], out, workers=1)
    assert again.reused and again.tokens == {"train": 5, "val": 0}
    assert (out / "metadata.json").stat().st_mtime_ns == stamp
    _write(f, "abcd\n")
    with pytest.raises(InvalidInputError, match="holds data prepared from other inputs") as refused:
        prepare_data([f], out, workers=1)  # other data: a run may be training on what is there
    assert "--overwrite" in str(refused.value) and (out / "metadata.json").stat().st_mtime_ns == stamp
    assert not prepare_data([f], out, workers=1, overwrite=True).reused
    assert _docs(_tokens(out, "train")) == [b"abcd\n"]
    (out / "train-00000.npy").unlink()  # a damaged output is rebuilt, not trusted
    assert not prepare_data([f], out, workers=1).reused


def test_empty_input_is_an_error_or_skipped(tmp_path: Path) -> None:
    empty = _write(tmp_path / "in" / "empty.txt", "")
    full = _write(tmp_path / "in" / "full.txt", "data\n")
    with pytest.raises(InvalidInputError, match=r"empty\.txt is empty"):
        prepare_data([empty, full], tmp_path / "out", workers=1)
    res = prepare_data([tmp_path / "in"], tmp_path / "out", skip_bad_records=True, workers=1)
    assert res.skipped_files == 1 and res.tokens["train"] == 6
    with pytest.raises(InvalidInputError, match="does not exist"):
        prepare_data([tmp_path / "nope.txt"], tmp_path / "out3", workers=1)


def test_invalid_utf8_names_file_and_line_or_is_skipped(tmp_path: Path) -> None:
    f = _write(tmp_path / "t.txt", b"good line\nbad \xff line\nlast line\n")
    with pytest.raises(InvalidInputError, match=r"t\.txt line 2: invalid UTF-8 at byte 14"):
        prepare_data([f], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    res = prepare_data([f], tmp_path / "out", skip_bad_records=True, val_fraction=0, workers=1)
    assert res.skipped_records == 1
    assert _docs(_tokens(tmp_path / "out", "train")) == [b"good line\nlast line\n"]
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["skipped_examples"] == [f"{f.resolve()} line 2: invalid UTF-8 at byte 14"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ('{"body": "x"}', r"line 3: record has no field 'text' \(has: body\)"),
        ('{"text": 5}', "line 3: field 'text' is int, not a string"),
        ("{not json", r"line 3: invalid JSON"),
        ("[1, 2]", r"line 3: record has no field 'text' \(has: list\)"),
    ],
)
def test_bad_jsonl_record_names_file_and_line_or_is_skipped(tmp_path: Path, record: str, message: str) -> None:
    f = _write(tmp_path / "d.jsonl", f'{{"text": "a"}}\n{{"text": "b"}}\n{record}\n{{"text": "c"}}\n')
    with pytest.raises(InvalidInputError, match=r"d\.jsonl " + message):
        prepare_data([f], tmp_path / "out", workers=1)
    res = prepare_data([f], tmp_path / "out", skip_bad_records=True, val_fraction=0, workers=1)
    assert res.skipped_records == 1 and _docs(_tokens(tmp_path / "out", "train")) == [b"a", b"b", b"c"]


def test_bad_tokenizer_options_and_foreign_out_dir(tmp_path: Path) -> None:
    f = _write(tmp_path / "t.txt", "abc\n")
    bad_tok = _write(tmp_path / "tokenizer.json", "{ nope")
    with pytest.raises(InvalidInputError, match=r"tokenizer\.json does not parse"):
        prepare_data([f], tmp_path / "out", tokenizer=str(bad_tok), workers=1)
    with pytest.raises(InvalidInputError, match="--val-fraction"):
        prepare_data([f], tmp_path / "out", val_fraction=1.5, workers=1)
    _write(tmp_path / "mine" / "notes.txt", "keep me")
    with pytest.raises(InvalidInputError, match="was not written by `kforge prepare-data`"):
        prepare_data([f], tmp_path / "mine", workers=1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_very_long_line_is_cut_at_a_character_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs_mod, "MAX_TEXT_SCAN", 16)
    data = "é" * 100  # 200 bytes, no newline
    f = _write(tmp_path / "t.txt", data)
    with open(f, "rb") as fh:
        assert inputs_mod.cut(fh, 51, 200, "text") == 50  # byte 51 is inside a character: back off
        assert inputs_mod.cut(fh, 50, 200, "text") == 50
        assert inputs_mod.cut(fh, 51, 200, "jsonl") == 200  # a record is never cut


def test_val_segments_are_spread_and_at_least_one() -> None:
    assert inputs_mod.val_segments(1, 0.5) == set()
    assert inputs_mod.val_segments(272, 0.01) == {45, 136, 226}
    assert len(inputs_mod.val_segments(10, 0.001)) == 1
    assert inputs_mod.val_segments(10, 0.0) == set()


def test_an_error_in_a_worker_process_reaches_the_caller(tmp_path: Path) -> None:
    good = _write(tmp_path / "in" / "a.txt", "fine\n" * 2000)
    bad = _write(tmp_path / "in" / "b.jsonl", '{"text": "x"}\n{"text": "y"\n')
    with pytest.raises(InvalidInputError, match=r"b\.jsonl line 2: invalid JSON"):
        prepare_data([good, bad], tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_every_output_file_and_directory_is_fsynced_before_the_rename_publishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from kforge_cli.engine.data.prepare import prepare_run as pipeline

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, pipeline.replace_dir

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def recording_replace(tmp: Path, out: Path) -> None:
        events.append(("rename", str(tmp)))
        real_replace(tmp, out)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(pipeline, "replace_dir", recording_replace)
    src = _write(tmp_path / "in.txt", "hello world\n" * 2000)
    out = tmp_path / "out"
    prepare_data([src], out, val_fraction=0.1, shard_tokens=5000, workers=1)
    [rename_at] = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    tmp = Path(events[rename_at][1])
    synced_before = {
        Path(p).relative_to(tmp) for kind, p in events[:rename_at] if kind == "fsync" and p.startswith(str(tmp))
    }
    published = {p.relative_to(out) for p in out.rglob("*")}
    assert len(published) >= 5 and {Path("metadata.json"), Path("train-00000.npy"), Path("val-00000.npy")} <= published
    assert published | {Path(".")} <= synced_before  # every file, and the directory's own entries
    assert ("fsync", str(out.parent)) in events[rename_at:]  # the rename itself made durable
