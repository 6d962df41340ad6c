"""prepare-data on local Hugging Face datasets: same tokens as JSONL, exact sharding, bad records, no Hub."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from kforge_cli.engine.data.prepare import hf_source  # noqa: E402
from kforge_cli.engine.data.prepare import inputs as inputs_mod  # noqa: E402
from kforge_cli.engine.data.prepare.prepare_run import prepare_data  # noqa: E402
from kforge_cli.engine.data.shards import load_prepared  # noqa: E402
from kforge_cli.errors import InvalidInputError  # noqa: E402

EOS = 256
TEXTS = [f"record {i}: {'héllo wörld ' * (i % 7)}{'x' * (i % 13)}" for i in range(1200)]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    datasets.disable_progress_bars()


def _tokens(out: Path, split: str) -> np.ndarray:
    parts = [np.load(s.path) for s in load_prepared(out).splits.get(split, [])]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)


def _docs(tokens: np.ndarray) -> list[str]:
    cuts = np.flatnonzero(tokens == EOS)
    assert len(tokens) == 0 or cuts[-1] == len(tokens) - 1  # every document ends with EOS
    return [
        tokens[a + 1 : b].astype(np.uint8).tobytes().decode() for a, b in zip(np.r_[-1, cuts[:-1]], cuts, strict=True)
    ]


def _disk(tmp_path: Path, name: str, columns: dict[str, list[object]]) -> Path:
    path = tmp_path / name
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


def _parquet(tmp_path: Path, name: str, columns: dict[str, list[object]], rows_per_group: int = 250) -> Path:
    path = tmp_path / f"{name}.parquet"
    datasets.Dataset.from_dict(columns).to_parquet(str(path), batch_size=rows_per_group)
    return path


def _jsonl(tmp_path: Path, name: str, texts: list[str]) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_datasets_give_the_tokens_of_the_same_texts_as_jsonl(tmp_path: Path, workers: int) -> None:
    disk = _disk(tmp_path, "ds", {"text": TEXTS, "id": list(range(len(TEXTS)))})
    parquet = _parquet(tmp_path, "pq", {"text": TEXTS[::-1]})
    ref_inputs = [_jsonl(tmp_path, "a", TEXTS), _jsonl(tmp_path, "b", TEXTS[::-1])]
    ref = prepare_data(ref_inputs, tmp_path / "ref", val_fraction=0.0, workers=1)
    res = prepare_data([disk, Path(f"hf:{parquet}")], tmp_path / "out", val_fraction=0.0, workers=workers)
    assert res.workers == workers  # 2: several work units really went to two processes
    got = _tokens(tmp_path / "out", "train")
    assert np.array_equal(got, _tokens(tmp_path / "ref", "train"))  # no record lost, duplicated or moved
    assert _docs(got) == TEXTS + TEXTS[::-1]
    assert res.documents == ref.documents == {"train": 2400, "val": 0}
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["records"] == 2400 and meta["skipped_records"] == 0
    src = meta["sources"][1]
    assert (src["kind"], src["format"], src["records"], src["files"]) == ("hf", "parquet", 1200, 1)
    assert src["sha256"] == hashlib.sha256(parquet.read_bytes()).hexdigest()
    assert meta["sources"][0]["format"] == "save_to_disk" and meta["sources"][0]["path"] == str(disk.resolve())


def test_val_split_is_whole_segments_and_independent_of_workers(tmp_path: Path) -> None:
    parquet = _parquet(tmp_path, "pq", {"text": TEXTS}, rows_per_group=100)
    one = prepare_data([parquet], tmp_path / "one", val_fraction=0.1, workers=1)
    two = prepare_data([parquet], tmp_path / "two", val_fraction=0.1, workers=2, shard_tokens=5000)
    assert two.workers == 2 and len(load_prepared(tmp_path / "two").splits["train"]) > 1
    for split in ("train", "val"):
        assert np.array_equal(_tokens(tmp_path / "one", split), _tokens(tmp_path / "two", split))
    train, val = _docs(_tokens(tmp_path / "one", "train")), _docs(_tokens(tmp_path / "one", "val"))
    assert sorted(train + val) == sorted(TEXTS)  # every record exactly once
    assert one.documents == {"train": len(train), "val": len(val)} and 0.05 < len(val) / len(TEXTS) < 0.2
    ds = hf_source.resolve(parquet)  # val: the records of the evenly spread val segments of r records each
    r = hf_source.records_per_segment(ds, inputs_mod.segment_bytes_for(ds.size))
    chosen = inputs_mod.val_segments(-(-len(TEXTS) // r), 0.1)
    assert r > 1 and chosen and val == [t for i, t in enumerate(TEXTS) if i // r in chosen]


def test_rerun_is_a_no_op_and_a_changed_dataset_rebuilds(tmp_path: Path) -> None:
    disk = _disk(tmp_path, "ds", {"text": TEXTS[:50]})
    out = tmp_path / "out"
    assert not prepare_data([disk], out, workers=1).reused
    assert prepare_data([disk], out, workers=1).reused
    _disk(tmp_path, "ds", {"text": ["changed"] * 3})
    assert not prepare_data([disk], out, val_fraction=0.0, workers=1, overwrite=True).reused
    assert _docs(_tokens(out, "train")) == ["changed"] * 3


@pytest.mark.parametrize("kind", ["disk", "parquet"])
def test_a_null_record_names_dataset_and_index_or_is_skipped(tmp_path: Path, kind: str) -> None:
    texts: list[str | None] = list(TEXTS)
    texts[777] = None  # in the fourth row group of the parquet file
    path = _disk(tmp_path, "ds", {"text": texts}) if kind == "disk" else _parquet(tmp_path, "ds", {"text": texts})
    with pytest.raises(InvalidInputError, match=rf"dataset {path.resolve()} record 777: field 'text' is null"):
        prepare_data([path], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()
    res = prepare_data([path], tmp_path / "out", skip_bad_records=True, val_fraction=0.0, workers=1)
    assert res.skipped_records == 1 and _docs(_tokens(tmp_path / "out", "train")) == TEXTS[:777] + TEXTS[778:]
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["skipped_examples"] == [f"dataset {path.resolve()} record 777: field 'text' is null"]


def test_missing_or_non_string_field_is_a_bad_record(tmp_path: Path) -> None:
    disk = _disk(tmp_path, "ds", {"body": ["a", "b"], "n": [1, 2]})
    with pytest.raises(InvalidInputError, match=r"record 0: record has no field 'text' \(has: body, n\); use --text"):
        prepare_data([disk], tmp_path / "out", workers=1)
    with pytest.raises(InvalidInputError, match=r"record 0: field 'n' is int, not a string"):
        prepare_data([disk], tmp_path / "out", text_field="n", workers=1)
    with pytest.raises(InvalidInputError, match="contain no text"):  # every record skipped: nothing left
        prepare_data([disk], tmp_path / "out", skip_bad_records=True, workers=1)
    res = prepare_data([disk], tmp_path / "out", text_field="body", val_fraction=0.0, workers=1)
    assert _docs(_tokens(tmp_path / "out", "train")) == ["a", "b"] and res.skipped_records == 0
    mixed = _jsonl(tmp_path, "m", ["x"])
    res = prepare_data([mixed, disk], tmp_path / "out2", skip_bad_records=True, val_fraction=0.0, workers=1)
    assert res.skipped_records == 2 and _docs(_tokens(tmp_path / "out2", "train")) == ["x"]


def test_hub_ids_and_urls_are_refused_and_datasets_runs_offline(tmp_path: Path) -> None:
    for spec in ("hf:HuggingFaceFW/fineweb", "hf:wikitext", "hf:hf://datasets/org/name"):
        with pytest.raises(InvalidInputError, match="is not a local path: .* never downloads from the Hugging"):
            prepare_data([Path(spec)], tmp_path / "out", workers=1)
    with pytest.raises(InvalidInputError, match=r"hf:/no/such/dir does not exist"):
        prepare_data([Path("hf:/no/such/dir")], tmp_path / "out", workers=1)
    hf_source.resolve(_disk(tmp_path, "ds", {"text": ["a"]}))
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and datasets.config.HF_DATASETS_OFFLINE is True


def test_missing_datasets_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _disk(tmp_path, "ds", {"text": ["a"]})
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(InvalidInputError, match=r"needs `datasets`: pip install 'kforge\[hf\]'"):
        prepare_data([disk], tmp_path / "out", workers=1)


def test_dataset_dict_splits_and_a_walked_directory(tmp_path: Path) -> None:
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["tr1", "tr2"]}),
            "test": datasets.Dataset.from_dict({"text": ["te"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "corpus" / "dd"))
    (tmp_path / "corpus" / "a.txt").write_text("plain text\n")
    prepare_data([tmp_path / "corpus"], tmp_path / "out", val_fraction=0.0, workers=1)
    # the text file, then the dict's train split; its json files are not read as text
    assert _docs(_tokens(tmp_path / "out", "train")) == ["plain text\n", "tr1", "tr2"]
    prepare_data([tmp_path / "corpus" / "dd"], tmp_path / "test", val_fraction=0.0, hf_split="test", workers=1)
    assert _docs(_tokens(tmp_path / "test", "train")) == ["te"]
    with pytest.raises(InvalidInputError, match="DatasetDict with splits train, test: choose one with --hf-split"):
        prepare_data([tmp_path / "corpus" / "dd"], tmp_path / "x", hf_split="validation", workers=1)
    single = _disk(tmp_path, "single", {"text": ["a"]})
    with pytest.raises(InvalidInputError, match="holds a single split: drop --hf-split"):
        prepare_data([single], tmp_path / "x", hf_split="test", workers=1)
    empty = _parquet(tmp_path, "empty", {"text": []})
    with pytest.raises(InvalidInputError, match="has no records"):
        prepare_data([empty, single], tmp_path / "x", workers=1)
    assert prepare_data([empty, single], tmp_path / "x", skip_bad_records=True, workers=1).skipped_files == 1


def test_a_directory_of_arrow_files_is_one_dataset(tmp_path: Path) -> None:
    src = _disk(tmp_path, "ds", {"text": TEXTS[:300]})
    arrows = sorted(src.glob("*.arrow"))
    files = tmp_path / "files"
    files.mkdir()
    for i, a in enumerate(arrows + arrows):  # the same shard twice: 600 records
        (files / f"part-{i}.arrow").write_bytes(a.read_bytes())
    res = prepare_data([Path(f"hf:{files}")], tmp_path / "out", val_fraction=0.0, workers=1)
    assert _docs(_tokens(tmp_path / "out", "train")) == TEXTS[:300] * 2 and res.documents["train"] == 600
    (files / "x.parquet").write_bytes(_parquet(tmp_path, "p", {"text": ["a"]}).read_bytes())
    with pytest.raises(InvalidInputError, match="mixes .parquet and .arrow files"):
        prepare_data([Path(f"hf:{files}")], tmp_path / "out", workers=1)


def test_build_data_trains_on_a_prepared_dataset(tmp_path: Path) -> None:
    import torch

    from kforge_cli.engine.data import build_data
    from kforge_cli.settings import JobSettings

    prepare_data([_disk(tmp_path, "ds", {"text": TEXTS})], tmp_path / "out", val_fraction=0.1, workers=1)
    s = JobSettings()
    s.model.vocab_size, s.train.batch_size, s.train.seq_len = 320, 2, 16
    s.data.path = str(tmp_path / "out")
    bundle = build_data(s, dp_rank=0, dp_size=1)
    assert bundle.vocab_size == 257 and bundle.val is not None
    stream = _tokens(tmp_path / "out", "train").astype(np.int64)
    for batch in islice(iter(bundle.train), 3):
        assert batch["input_ids"].shape == (2, 16)
        assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
        for row in batch["input_ids"].numpy():  # every row is a window of the prepared train tokens
            at = stream.tobytes().find(row.tobytes())
            assert at >= 0 and at % 8 == 0
