"""Token streams (memory-mapped shards or an in-memory array), windows, and batch tensors.

A split is one logical stream of token ids: its shards concatenated. Window ``i``
covers tokens ``[i*seq_len, i*seq_len + seq_len + 1)``: inputs are the first
``seq_len``, labels the last ``seq_len``. Windows may straddle shards.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kforge_cli.engine.data.shards import ShardInfo
from kforge_cli.errors import InvalidInputError

if TYPE_CHECKING:  # torch loads with the first batch: `kforge data-trace` reads windows without it
    import torch

IGNORE_INDEX = -100  # label value cross-entropy skips


class TokenStream(Protocol):
    """Random access to a 1-D stream of token ids."""

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class ArrayTokens:
    """An in-memory stream (the built-in corpus, tests)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


class ShardedTokens:
    """Shards of a prepared split, memory-mapped lazily in each process that reads them.

    The maps are not pickled: a DataLoader worker re-opens them instead of receiving a
    copy of the data, so memory stays flat however large the split is.
    """

    def __init__(self, shards: list[ShardInfo]) -> None:
        self.shards = list(shards)
        self.offsets = np.cumsum([0] + [s.tokens for s in self.shards])
        self._maps: list[np.ndarray] | None = None
        self._pid = -1

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_maps": None, "_pid": -1}

    def _arrays(self) -> list[np.ndarray]:
        if self._maps is None or self._pid != os.getpid():
            self._maps = [np.load(s.path, mmap_mode="r", allow_pickle=False) for s in self.shards]
            self._pid = os.getpid()
        return self._maps

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Where tokens ``[start, stop)`` of the split lie: (shard index, offset in that shard, length) each."""
        out = []
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            lo = start - int(self.offsets[i])
            take = min(stop - start, self.shards[i].tokens - lo)
            out.append((i, lo, take))
            start += take
            i += 1
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        maps = self._arrays()
        parts = []
        for i, lo, take in self.pieces(start, stop):
            part = maps[i][lo : lo + take]
            self._check_ids(i, part)
            parts.append(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _check_ids(self, i: int, part: np.ndarray) -> None:
        """The vocabulary check at load trusted the shard's cached ``max_id``: every read verifies it (a max over a
        window is nothing next to the step), so a lying metadata.json is an error naming the shard, not an
        ``IndexError`` (a device-side assert on GPU) in the embedding mid-training."""
        claimed = self.shards[i].max_id
        if claimed >= 0 and part.size and int(part.max()) > claimed:
            raise InvalidInputError(
                f"{self.shards[i].path} holds token id {int(part.max())}, above the max_id {claimed} its "
                "metadata.json records (which the vocabulary check relied on): the prepared directory is damaged "
                "or was edited; prepare it again"
            )


class Windows:
    """Non-overlapping training windows of ``seq_len + 1`` tokens over one stream."""

    def __init__(self, stream: TokenStream, seq_len: int) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.num_windows = max(0, (len(stream) - 1) // seq_len)

    def span(self, index: int) -> tuple[int, int]:
        """Window ``index``'s tokens in the stream: ``[start, stop)``, ``seq_len + 1`` of them."""
        return index * self.seq_len, (index + 1) * self.seq_len + 1

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """Windows ``indices`` as an int64 array of shape [len(indices), seq_len + 1]."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices.tolist()):
            out[row] = self.stream.read(*self.span(i))
        return out


def document_fields(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_ids, positions, boundary) for inputs [B, T].

    A token belongs to the document its nearest following EOS closes (the EOS included);
    ``positions`` restart at 0 after every EOS; ``boundary`` marks inputs that are EOS,
    whose next token starts another document and so must not be a label.
    """
    is_eos = inputs == eos_id
    doc_ids = np.cumsum(is_eos, axis=1) - is_eos
    steps = np.arange(inputs.shape[1])
    starts = np.zeros_like(inputs)
    starts[:, 1:] = np.where(is_eos[:, :-1], steps[1:], 0)
    positions = steps - np.maximum.accumulate(starts, axis=1)
    return doc_ids, positions, is_eos


def make_batch(
    rows: np.ndarray, dataset_ids: np.ndarray, eos_id: int, document_masking: bool
) -> dict[str, torch.Tensor]:
    """Rows [B, T+1] -> the batch dict the training loop consumes (CPU tensors)."""
    import torch

    inputs, labels = rows[:, :-1], rows[:, 1:].copy()
    batch: dict[str, torch.Tensor] = {"input_ids": torch.from_numpy(np.ascontiguousarray(inputs))}
    if document_masking:
        doc_ids, positions, boundary = document_fields(inputs, eos_id)
        labels[boundary] = IGNORE_INDEX
        batch["doc_ids"] = torch.from_numpy(doc_ids.astype(np.int64))
        batch["positions"] = torch.from_numpy(positions.astype(np.int64))
    batch["labels"] = torch.from_numpy(labels)
    batch["dataset_ids"] = torch.from_numpy(dataset_ids.astype(np.int64))
    return batch
