"""The real `kforge prepare-data` on tinyshakespeare, its re-run, and a bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

SHAKESPEARE = Path(__file__).parents[2].parent / "shared/data/tinyshakespeare.txt"


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} is absent (the shared data directory)")
def test_prepare_tinyshakespeare_byte_level(kforge, tmp_path: Path) -> None:
    out = tmp_path / "shakespeare"
    r = kforge("prepare-data", str(SHAKESPEARE), "--tokenizer", "byte", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout
    meta = json.loads((out / "metadata.json").read_text())
    size = SHAKESPEARE.stat().st_size
    assert (meta["vocab_size"], meta["dtype"]) == (257, "uint16")
    train, val = (np.load(out / f"{split}-00000.npy") for split in ("train", "val"))
    assert train.dtype == np.uint16 and len(train) == meta["splits"]["train"]["tokens"]
    assert len(val) > 0 and 0.005 < len(val) / size < 0.02  # --val-fraction defaults to 1%
    # every byte of the file is in exactly one split; the rest are EOS separators
    assert int((train != 256).sum() + (val != 256).sum()) == size
    assert bytes(train[:10].astype(np.uint8)) == SHAKESPEARE.read_bytes()[:10]
    again = kforge("prepare-data", str(SHAKESPEARE), "--tokenizer", "byte", "--out", str(out))
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
