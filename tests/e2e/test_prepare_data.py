"""The real `kforge prepare-data` on tinyshakespeare, its re-run, and a bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e


def stories_file(path: Path, documents: int = 1500) -> Path:
    """A text file of the built-in corpus's stories (no file outside the repository is needed)."""
    from kforge_cli.engine.data.builtin_corpus import generate_documents

    path.write_text("".join(doc.rstrip("\n") + "\n" for doc in generate_documents(documents)))
    return path


def test_prepare_a_text_file_byte_level(kforge, tmp_path: Path) -> None:
    text = stories_file(tmp_path / "stories.txt")
    out = tmp_path / "stories"
    r = kforge("prepare-data", str(text), "--tokenizer", "byte", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout
    meta = json.loads((out / "metadata.json").read_text())
    size = text.stat().st_size
    assert (meta["vocab_size"], meta["dtype"]) == (257, "uint16")
    train, val = (np.load(out / f"{split}-00000.npy") for split in ("train", "val"))
    assert train.dtype == np.uint16 and len(train) == meta["splits"]["train"]["tokens"]
    assert len(val) > 0 and 0.005 < len(val) / size < 0.02  # --val-fraction defaults to 1%
    # every byte of the file is in exactly one split; the rest are EOS separators
    assert int((train != 256).sum() + (val != 256).sum()) == size
    assert bytes(train[:10].astype(np.uint8)) == text.read_bytes()[:10]
    again = kforge("prepare-data", str(text), "--tokenizer", "byte", "--out", str(out))
    assert again.returncode == 0 and "up to date" in again.stdout


def test_bad_input_exits_2_naming_the_file_and_line(kforge, tmp_path: Path) -> None:
    bad = tmp_path / "records.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    r = kforge("prepare-data", str(bad), "--out", str(tmp_path / "out"))
    assert r.returncode == 2
    assert f"{bad} line 2: record has no field 'text'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    ok = kforge("prepare-data", str(bad), "--out", str(tmp_path / "out"), "--skip-bad-records", "-q")
    assert ok.returncode == 0 and "skipped 1 bad record(s)" in ok.stdout


SLOW_PREPARE = """
import sys, time
from kforge_cli.engine.data.prepare import prepare_run as pipeline
real = pipeline.encode_unit
def slow(*args):
    time.sleep(1.5)  # a large input, in effect: SIGTERM arrives while units are being tokenized
    return real(*args)
pipeline.encode_unit = slow
from kforge_cli.cli.app import main
main(sys.argv[1:])
"""


def test_sigterm_mid_run_removes_the_temporary_directory_and_keeps_the_old_output(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "in.txt"
    src.write_text("to be or not to be\n" * 20_000)  # 380 kB: 4 work units, 1.5 s each
    out = tmp_path / "out"
    args = ["prepare-data", str(src), "--out", str(out), "--workers", "1", "-q"]

    def temporaries() -> list[Path]:
        return [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]

    for previous in (None, "older"):
        if previous:  # a finished earlier output: stays exactly as it was
            out.mkdir()
            (out / "metadata.json").write_text(json.dumps({"format": "kforge-tokens", "older": True}))
        replace = ["--overwrite"] if previous else []  # other data at --out: replaced only when asked
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_PREPARE, *args, *replace], stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 60
        while not temporaries() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a unit in: part files and shards exist in the temporary directory
        assert temporaries() and proc.poll() is None
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err  # 128 + SIGTERM, as documented in `kforge prepare-data --help`
        assert "Traceback" not in err and temporaries() == []
        if previous:
            assert json.loads((out / "metadata.json").read_text())["older"] is True
        else:
            assert not out.exists()


def test_documents_are_defined_per_input_kind_and_metadata_summary_and_eos_ids_agree(kforge, tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("".join(f"line {i} of a text file with some words\n" for i in range(1500)))
    records = tmp_path / "b.jsonl"
    records.write_text("".join(json.dumps({"text": f"record {i} " * 5}) + "\n" for i in range(500)))
    out = tmp_path / "out"
    r = kforge("prepare-data", str(text), str(records), "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "metadata.json").read_text())
    assert set(meta["documents"]) == {"text", "jsonl", "hf"} and meta["text_files"] == 1
    for split, info in meta["splits"].items():
        eos = sum(int((np.load(out / s["file"]) == meta["eos_id"]).sum()) for s in info["shards"])
        assert eos == info["documents"] == sum(info["documents_by_kind"].values()), split
    # the one text file loses lines from its middle to val: 2 pieces in train, 1 in val, each a document
    assert meta["splits"]["train"]["documents_by_kind"] == {"text": 2, "jsonl": 500, "hf": 0}
    assert meta["splits"]["val"]["documents_by_kind"] == {"text": 1, "jsonl": 0, "hf": 0}
    assert (
        "documents (each ends with EOS): 502 train + 1 val = 500 JSONL records + 1 text file in 3 pieces "
        "(the val split takes lines out of text files; a piece is a document)"
    ) in r.stdout.splitlines()
