"""`build_data`: settings -> the train loader, val data and tokenizer of one rank.

Training data is, in order of precedence, a mixture (``data.datasets``), one prepared
directory (``data.path``), or the built-in demo corpus. Validation data is
``eval.path`` (its val split, or its train split if it has none) or the val splits of
the training datasets. Every mismatch a user can cause (vocabulary larger than the
model's, sequences longer than the data, mixed tokenizers) is a KforgeError here,
before any step runs.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from kforge_cli.engine.data.loader import BatchFetcher, StatefulLoader, training_loader
from kforge_cli.engine.data.mixture import MixtureSchedule
from kforge_cli.engine.data.sources import Source, prepared_source, training_sources
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kforge_cli.engine.data.tokens import TokenStream, Windows, make_batch
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings
from kforge_cli.settings.data_check import TOKENIZER_FILE

log = logging.getLogger(__name__)


class EvalBatches(Protocol):
    """Deterministic validation batches of one data-parallel rank."""

    def iter_batches(self, num_batches: int, batch_size: int) -> Iterator[dict[str, torch.Tensor]]: ...


class TrainData(Protocol):
    """What training needs of its data; the text `DataBundle` and the VLM bundle both satisfy it."""

    @property
    def train(self) -> StatefulLoader: ...

    @property
    def val(self) -> EvalBatches | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def dataset_names(self) -> list[str]: ...


class ValData:
    """Deterministic validation micro-batches, partitioned over data-parallel ranks.

    Batch ``b`` comes from val dataset ``b % D`` (round robin); within a dataset, rank
    ``r`` reads consecutive windows starting at ``(k * dp_size + r) * batch_size`` for its
    ``k``-th batch there, wrapping around. Every call yields the same batches.
    """

    def __init__(
        self,
        windows: list[Windows],
        dataset_ids: list[int],
        dataset_names: list[str],
        *,
        eos_id: int,
        document_masking: bool,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.windows, self.dataset_ids, self.dataset_names = windows, dataset_ids, dataset_names
        self.eos_id, self.document_masking = eos_id, document_masking
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def iter_batches(self, num_batches: int, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """``num_batches`` micro-batches of ``batch_size`` sequences (dataset_ids index dataset_names)."""
        for b in range(num_batches):
            which = b % len(self.windows)
            win, k = self.windows[which], b // len(self.windows)
            start = (k * self.dp_size + self.dp_rank) * batch_size
            idx = (start + np.arange(batch_size)) % win.num_windows
            ids = np.full(batch_size, self.dataset_ids[which], dtype=np.int64)
            yield make_batch(win.rows(idx), ids, self.eos_id, self.document_masking)

    def iter_split(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Every window of every val dataset exactly once, dataset by dataset, ``batch_size`` at a time.

        The last batch of a dataset holds what is left (it may be shorter). One process's view:
        the data-parallel partition does not apply (``kforge eval`` runs on one process).
        """
        for which, win in enumerate(self.windows):
            for start in range(0, win.num_windows, batch_size):
                idx = np.arange(start, min(start + batch_size, win.num_windows))
                ids = np.full(len(idx), self.dataset_ids[which], dtype=np.int64)
                yield make_batch(win.rows(idx), ids, self.eos_id, self.document_masking)

    def split_batches(self, batch_size: int) -> int:
        """How many batches :meth:`iter_split` yields."""
        return sum(-(-w.num_windows // batch_size) for w in self.windows)


@dataclass
class DataBundle:
    """What the training loop gets from the data layer for one rank."""

    train: StatefulLoader
    val: ValData | None
    vocab_size: int
    dataset_names: list[str]
    tokenizer: Tokenizer


def _tokenizer_for(sources: list[Source], requested: str) -> Tokenizer:
    """The tokenizer all sources share (refusing a mix), checked against data.tokenizer."""
    first = sources[0]
    for s in sources[1:]:
        if s.tokenizer != first.tokenizer:
            raise InvalidInputError(
                f"datasets {first.name!r} ({first.origin}) and {s.name!r} ({s.origin}) were prepared with different "
                "tokenizers; prepare every dataset of a mixture with the same --tokenizer"
            )
    if first.tokenizer.get("kind") == "byte":
        if requested != "byte":
            raise InvalidInputError(
                f"data.tokenizer={requested!r} but {first.origin} was prepared with the byte tokenizer; "
                "set data.tokenizer=byte or prepare the data again with your tokenizer"
            )
        return ByteTokenizer()
    assert first.root is not None
    tok = HFTokenizer(first.root / TOKENIZER_FILE)
    if tok.sha256 != first.tokenizer.get("sha256"):
        raise InvalidInputError(f"{first.root / TOKENIZER_FILE} does not match the tokenizer in its metadata.json")
    if requested != "byte":
        path = Path(requested).expanduser()
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != tok.sha256:
            raise InvalidInputError(
                f"data.tokenizer={requested!r} is not the tokenizer {first.origin} was prepared with; "
                "leave data.tokenizer at its default to use the prepared one"
            )
    return tok


def _windows(source: Source, stream: TokenStream, split: str, seq_len: int) -> Windows:
    win = Windows(stream, seq_len)
    if win.num_windows < 1:
        raise InvalidInputError(
            f"the {split} split of {source.origin} has {len(stream)} tokens, fewer than train.seq_len + 1 = "
            f"{seq_len + 1}: lower train.seq_len or prepare more data"
        )
    return win


def _val_data(
    eval_path: str | None,
    sources: list[Source],
    tok: Tokenizer,
    *,
    seq_len: int,
    document_masking: bool,
    dp_rank: int,
    dp_size: int,
) -> ValData | None:
    """Validation windows: of ``eval_path`` (``eval.path``) if set, else of each source's val split."""
    if eval_path:
        src = prepared_source("eval", eval_path)
        if src.tokenizer != sources[0].tokenizer:
            raise InvalidInputError(f"eval.path {src.origin} was prepared with another tokenizer than the train data")
        stream = src.val or src.train
        pairs = [(0, _windows(src, stream, "val" if src.val else "train", seq_len))]
        names = ["eval"]
    else:
        names = [s.name for s in sources]
        pairs = [(i, Windows(s.val, seq_len)) for i, s in enumerate(sources) if s.val is not None]
        for i, w in pairs:
            if w.num_windows < 1:
                log.warning("val split of %s is shorter than seq_len + 1 tokens; not evaluated", sources[i].origin)
        pairs = [(i, w) for i, w in pairs if w.num_windows >= 1]
    if not pairs:
        return None
    return ValData(
        [w for _, w in pairs],
        [i for i, _ in pairs],
        names,
        eos_id=tok.eos_id,
        document_masking=document_masking,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def build_data(settings: JobSettings, *, dp_rank: int, dp_size: int) -> DataBundle:
    """The train loader, val data and tokenizer of data-parallel rank ``dp_rank`` of ``dp_size``."""
    data, train = settings.data, settings.train
    sources = training_sources(data)
    tok = _tokenizer_for(sources, data.tokenizer)
    if tok.vocab_size > settings.model.vocab_size:
        raise InvalidInputError(
            f"the data's tokenizer ({tok.name}) has {tok.vocab_size} ids but model.vocab_size is "
            f"{settings.model.vocab_size}: set --model.vocab_size={tok.vocab_size} or more (a multiple of 64 is fastest)"
        )
    for s in sources:
        top, shard = s.top_shard
        if top >= settings.model.vocab_size:
            raise InvalidInputError(
                f"{s.origin}: shard {shard} holds token id {top} but model.vocab_size is {settings.model.vocab_size}; "
                "the data was made with another tokenizer, or the shard is damaged"
            )
    windows = [_windows(s, s.train, "train", train.seq_len) for s in sources]
    names = [s.name for s in sources]
    weights = [d.weight for d in data.datasets] if data.datasets else [1.0]
    schedule = MixtureSchedule.build(names, weights, data.temperature, data.phases)
    loader = training_loader(
        train,
        data,
        names,
        [w.num_windows for w in windows],
        schedule,
        BatchFetcher(windows, tok.eos_id, data.document_masking),
        seed=settings.data_seed,
        seq_len=train.seq_len,
        dp_rank=dp_rank,
        dp_size=dp_size,
        fingerprints=[s.fingerprint for s in sources],
    )
    val = _val_data(
        settings.eval.path,
        sources,
        tok,
        seq_len=train.seq_len,
        document_masking=data.document_masking,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    return DataBundle(train=loader, val=val, vocab_size=tok.vocab_size, dataset_names=names, tokenizer=tok)
