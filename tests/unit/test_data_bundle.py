"""`build_data` on the built-in corpus: batch shapes, val data, and the errors it raises."""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch

from kforge_cli.engine.data import DataBundle, build_data
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings


def _settings(**train: int) -> JobSettings:
    s = JobSettings()
    s.model.vocab_size = 320
    s.train.batch_size = train.get("batch_size", 4)
    s.train.seq_len = train.get("seq_len", 32)
    return s


def test_default_data_is_the_builtin_corpus_with_requested_batch_shape() -> None:
    bundle = build_data(_settings(batch_size=3, seq_len=16), dp_rank=0, dp_size=1)
    assert isinstance(bundle, DataBundle)
    assert bundle.dataset_names == ["builtin"] and bundle.vocab_size == 257
    batch = next(iter(bundle.train))
    assert set(batch) == {"input_ids", "labels", "dataset_ids"}
    assert batch["input_ids"].shape == (3, 16) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])  # labels are the next tokens
    assert batch["dataset_ids"].tolist() == [0, 0, 0]
    text = bundle.tokenizer.decode(batch["input_ids"][0].tolist())
    assert len(text) > 0 and bundle.tokenizer.encode("ab") == [97, 98]
    json.dumps(bundle.train.state_dict())


def test_document_masking_adds_doc_ids_and_positions() -> None:
    s = _settings(batch_size=8, seq_len=256)
    s.data.document_masking = True
    batch = next(iter(build_data(s, dp_rank=0, dp_size=1).train))
    assert set(batch) == {"input_ids", "labels", "dataset_ids", "doc_ids", "positions"}
    eos = batch["input_ids"] == 256
    assert eos.any()  # stories are ~330 bytes: a 256-token window usually crosses one
    assert (batch["labels"][eos] == -100).all() and (batch["labels"][~eos] != -100).all()


def test_val_batches_are_repeatable_and_differ_across_ranks() -> None:
    s = _settings(batch_size=2, seq_len=64)
    ranks = [build_data(s, dp_rank=r, dp_size=2).val for r in range(2)]
    assert ranks[0] is not None and ranks[1] is not None
    a = [b["input_ids"] for b in ranks[0].iter_batches(3, 5)]
    again = [b["input_ids"] for b in ranks[0].iter_batches(3, 5)]
    other = [b["input_ids"] for b in ranks[1].iter_batches(3, 5)]
    assert all(torch.equal(x, y) for x, y in zip(a, again, strict=True))
    assert a[0].shape == (5, 64)
    assert not torch.equal(a[0], other[0])


def test_same_seed_same_batches_other_seed_other_batches() -> None:
    def first(seed: int) -> torch.Tensor:
        s = _settings()
        s.train.data_seed = seed
        return next(iter(build_data(s, dp_rank=0, dp_size=1).train))["input_ids"]

    assert torch.equal(first(1), first(1)) and not torch.equal(first(1), first(2))


def test_vocab_larger_than_model_is_an_error() -> None:
    s = _settings()
    s.model.vocab_size = 256
    with pytest.raises(InvalidInputError, match=r"257 ids but model.vocab_size is 256"):
        build_data(s, dp_rank=0, dp_size=1)


def test_seq_len_longer_than_the_data_is_an_error() -> None:
    with pytest.raises(InvalidInputError, match=r"fewer than train.seq_len \+ 1"):
        build_data(_settings(seq_len=3_000_000), dp_rank=0, dp_size=1)


def test_tokenizer_path_without_data_path_is_an_error() -> None:
    s = _settings()
    s.data.tokenizer = "/some/tokenizer.json"
    with pytest.raises(InvalidInputError, match="built-in corpus is byte-tokenized"):
        build_data(s, dp_rank=0, dp_size=1)


def test_resume_through_build_data_continues_the_stream() -> None:
    s = _settings(batch_size=2, seq_len=16)
    ref = [b["input_ids"] for b in islice(iter(build_data(s, dp_rank=0, dp_size=1).train), 5)]
    first = build_data(s, dp_rank=0, dp_size=1).train
    got = [b["input_ids"] for b in islice(iter(first), 2)]
    resumed = build_data(s, dp_rank=0, dp_size=1).train
    resumed.load_state_dict(first.state_dict())
    got += [b["input_ids"] for b in islice(iter(resumed), 3)]
    assert all(torch.equal(x, y) for x, y in zip(ref, got, strict=True))
