"""`build_data` on the built-in corpus: batch shapes, val data, and the errors it raises."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch

from kforge_cli.engine.data import DataBundle, build_data
from kforge_cli.engine.data.builtin_corpus import generate_documents
from kforge_cli.engine.data.prepare.prepare_run import prepare_data
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings
from kforge_cli.settings.data import DataPhase, DatasetSpec


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


def _prepared(tmp_path: Path, name: str, text: str, tokenizer: str = "byte") -> str:
    src = tmp_path / f"{name}.txt"
    src.write_text(text)
    prepare_data([src], tmp_path / name, tokenizer=tokenizer, val_fraction=0.2, workers=1)
    return str(tmp_path / name)


def test_mixture_of_prepared_directories(tmp_path: Path) -> None:
    stories = "".join(generate_documents(40))
    web, books = _prepared(tmp_path, "web", stories), _prepared(tmp_path, "books", stories.upper())
    s = _settings(batch_size=8, seq_len=16)
    s.data.datasets = [DatasetSpec(name="web", path=web, weight=3.0), DatasetSpec(name="books", path=books)]
    s.data.phases = [DataPhase(start_step=50, dataset_weights={"books": 1.0})]
    bundle = build_data(s, dp_rank=0, dp_size=1)
    assert bundle.dataset_names == ["web", "books"]
    batches = list(islice(iter(bundle.train), 60))
    early = torch.cat([b["dataset_ids"] for b in batches[:50]])
    assert abs(float((early == 0).float().mean()) - 0.75) < 0.02
    assert all((b["dataset_ids"] == 1).all() for b in batches[50:])
    for b in batches[:5]:  # books are upper case: the dataset id tells where a row came from
        text = [bundle.tokenizer.decode(row.tolist()) for row in b["input_ids"]]
        assert [t == t.upper() for t in text] == [bool(d) for d in b["dataset_ids"].tolist()]
    assert bundle.val is not None and bundle.val.dataset_ids == [0, 1]
    assert [int(b["dataset_ids"][0]) for b in bundle.val.iter_batches(4, 2)] == [0, 1, 0, 1]


def test_prepared_hf_data_brings_its_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    stories = "".join(generate_documents(40))
    tok.train_from_iterator(stories.splitlines(), trainer)
    tok.save(str(tmp_path / "bpe.json"))
    s = _settings(seq_len=16)
    s.data.path = _prepared(tmp_path, "hf", stories, tokenizer=str(tmp_path / "bpe.json"))
    bundle = build_data(s, dp_rank=0, dp_size=1)
    assert bundle.vocab_size == 300 and bundle.tokenizer.eos_id == 0
    assert bundle.tokenizer.decode(bundle.tokenizer.encode("Story 3: Anna")) == "Story 3: Anna"
    s.model.vocab_size = 256
    with pytest.raises(InvalidInputError, match="300 ids but model.vocab_size is 256"):
        build_data(s, dp_rank=0, dp_size=1)
    s.model.vocab_size, s.data.tokenizer = 320, "byte"
    build_data(s, dp_rank=0, dp_size=1)  # the default tokenizer setting defers to the prepared one
    (tmp_path / "other.json").write_text("{}")
    s.data.tokenizer = str(tmp_path / "other.json")
    with pytest.raises(InvalidInputError, match="is not the tokenizer"):
        build_data(s, dp_rank=0, dp_size=1)
    s.data.tokenizer, hf_dir, s.data.path = "byte", s.data.path, None
    s.data.datasets = [
        DatasetSpec(name="a", path=hf_dir),
        DatasetSpec(name="b", path=_prepared(tmp_path, "b", stories)),
    ]
    with pytest.raises(InvalidInputError, match="prepared with different tokenizers"):
        build_data(s, dp_rank=0, dp_size=1)


def test_prepared_directory_problems_are_reported(tmp_path: Path) -> None:
    stories = "".join(generate_documents(40))
    s = _settings(seq_len=16)
    s.data.path = _prepared(tmp_path, "web", stories)
    s.eval.path = _prepared(tmp_path, "heldout", stories[:3000])
    bundle = build_data(s, dp_rank=0, dp_size=1)
    assert bundle.val is not None and bundle.val.dataset_names == ["eval"]
    s.train.seq_len = 100_000
    with pytest.raises(InvalidInputError, match=r"train split of .*web has \d+ tokens, fewer than train.seq_len"):
        build_data(s, dp_rank=0, dp_size=1)
    s.train.seq_len = 16
    (tmp_path / "web" / "train-00000.npy").unlink()
    with pytest.raises(InvalidInputError, match=r"shard train-00000.npy listed in metadata.json is missing"):
        build_data(s, dp_rank=0, dp_size=1)
    s.data.path = str(tmp_path / "nowhere")
    with pytest.raises(InvalidInputError, match="does not exist"):
        build_data(s, dp_rank=0, dp_size=1)
