"""Tokenizers, shard files, windows, document masking and the built-in corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kforge_cli.engine.data.builtin_corpus import builtin_tokens, generate_documents
from kforge_cli.engine.data.shards import SplitWriter, load_prepared
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, token_dtype
from kforge_cli.engine.data.tokens import ArrayTokens, ShardedTokens, ShardInfo, Windows, make_batch
from kforge_cli.errors import InvalidInputError


def _bpe_file(tmp_path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", *specials], show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat"] * 50 + ["a dog ran to the log"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_byte_tokenizer_round_trips_utf8_and_reserves_eos() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = tok.encode("héllo")
    assert ids == [104, 195, 169, 108, 108, 111]
    assert tok.decode([*ids, 256]) == "héllo"
    arr = tok.encode_bytes("héllo".encode(), np.dtype(np.uint16))
    assert arr.dtype == np.uint16 and arr.tolist() == ids


def test_smallest_dtype_that_fits_the_vocabulary() -> None:
    assert token_dtype(256) == np.uint8
    assert token_dtype(257) == np.uint16  # the byte tokenizer: 256 bytes + EOS
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_hf_tokenizer_uses_its_eos_token_or_adds_one(tmp_path: Path) -> None:
    with_eos = HFTokenizer(_bpe_file(tmp_path, ["<|endoftext|>"]))
    assert with_eos.eos_id == 1 and with_eos.eos_token == "<|endoftext|>"
    assert with_eos.decode(with_eos.encode("the cat sat")) == "the cat sat"
    assert with_eos.describe()["sha256"] == with_eos.sha256
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = HFTokenizer(_bpe_file(plain_dir, []))
    base = plain._tok.get_vocab_size(with_added_tokens=True)
    assert plain.eos_id == base and plain.vocab_size == base + 1
    assert plain.decode([*plain.encode("a dog"), plain.eos_id]) == "a dog"


def test_tokenizer_file_that_does_not_parse_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(InvalidInputError, match=r"tokenizer\.json does not parse"):
        load_tokenizer(str(bad))
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_split_writer_rolls_shards_and_reader_concatenates_them(tmp_path: Path) -> None:
    writer = SplitWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=10, eos_id=9)
    writer.append(np.arange(7, dtype=np.uint16))
    writer.append(np.array([7, 8, 9, 10, 11, 9, 12], dtype=np.uint16))
    info = writer.close()
    assert info["tokens"] == 14 and info["documents"] == 2
    assert [s["tokens"] for s in info["shards"]] == [10, 4]
    first = np.load(tmp_path / "train-00000.npy")
    assert first.dtype == np.uint16 and first.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    stream = ShardedTokens([ShardInfo(tmp_path / s["file"], s["tokens"]) for s in info["shards"]])
    assert len(stream) == 14
    assert stream.read(8, 13).tolist() == [8, 9, 10, 11, 9]  # straddles the two shards
    win = Windows(stream, seq_len=4)
    assert win.num_windows == 3  # (14 - 1) // 4
    assert win.rows(np.array([2, 0])).tolist() == [[8, 9, 10, 11, 9], [0, 1, 2, 3, 4]]


def test_document_masking_keeps_labels_and_positions_inside_documents() -> None:
    e = 99
    row = np.array([[1, 2, e, 3, 4, 5, e, 6, 7]])
    plain = make_batch(row, np.array([0]), e, document_masking=False)
    assert plain["labels"].tolist() == [[2, e, 3, 4, 5, e, 6, 7]]
    assert "doc_ids" not in plain
    masked = make_batch(row, np.array([3]), e, document_masking=True)
    assert masked["input_ids"].tolist() == [[1, 2, e, 3, 4, 5, e, 6]]
    assert masked["labels"].tolist() == [[2, e, -100, 4, 5, e, -100, 7]]
    assert masked["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert masked["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert masked["dataset_ids"].tolist() == [3]


def test_windows_of_an_array_stream() -> None:
    win = Windows(ArrayTokens(np.arange(20)), seq_len=6)
    assert win.num_windows == 3
    assert win.rows(np.array([1])).tolist() == [[6, 7, 8, 9, 10, 11, 12]]
    assert Windows(ArrayTokens(np.arange(6)), seq_len=6).num_windows == 0


def test_builtin_corpus_is_deterministic_and_split() -> None:
    assert generate_documents(3) == generate_documents(3)
    tokens = builtin_tokens()
    train, val = tokens["train"], tokens["val"]
    assert train.dtype == np.uint16 and int(train.max()) == 256
    assert 1_000_000 < len(train) < 2_000_000
    assert int((train == 256).sum()) == 4455 and int((val == 256).sum()) == 45  # 1% of 4500 stories
    text = ByteTokenizer().decode(val[: int(np.argmax(val == 256))].tolist())
    assert text.startswith("Story 99: ") and text.endswith("The end.\n")


def test_load_prepared_reports_missing_and_mismatched_shards(tmp_path: Path) -> None:
    import json

    writer = SplitWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=100, eos_id=256)
    writer.append(np.arange(50, dtype=np.uint16))
    meta = {
        "format": "kforge-tokens",
        "format_version": 1,
        "tokenizer": {"kind": "byte", "vocab_size": 257, "eos_id": 256},
        "vocab_size": 257,
        "eos_id": 256,
        "dtype": "uint16",
        "splits": {"train": writer.close()},
    }
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    assert load_prepared(tmp_path).split_tokens("train") == 50
    (tmp_path / "metadata.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    with pytest.raises(InvalidInputError, match=r"train-00000\.npy holds uint16\[50\] but metadata.json says uint32"):
        load_prepared(tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    (tmp_path / "train-00000.npy").unlink()
    with pytest.raises(InvalidInputError, match=r"shard train-00000\.npy .* is missing"):
        load_prepared(tmp_path)
    with pytest.raises(InvalidInputError, match="not a directory made by `kforge prepare-data`"):
        load_prepared(tmp_path / "..")
