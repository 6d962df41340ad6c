"""The on-disk format of a prepared directory: `.npy` token shards plus `metadata.json`.

    DIR/metadata.json        tokenizer, vocab size, dtype, token counts, sources, options
    DIR/train-00000.npy ...  1-D arrays of token ids, split "train"
    DIR/val-00000.npy ...    split "val" (absent when --val-fraction is 0)
    DIR/tokenizer.json       a copy of the Hugging Face tokenizer (byte tokenizer: none)

Shards are written as a stream (their length is unknown until the end), so the `.npy`
header has a fixed size and is rewritten with the final shape on close. Readers take
the dtype from metadata.json and check it against each shard's header: a dtype is
never guessed from a file size.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypedDict

import numpy as np

from kforge_cli.common.files import MAX_METADATA_BYTES, read_text_capped
from kforge_cli.common.json_values import int_of
from kforge_cli.errors import InvalidInputError

METADATA = "metadata.json"
FORMAT = "kforge-tokens"
FORMAT_VERSION = 1
_HEADER_BYTES = 128  # multiple of 64, room for any 1-D shape


class ShardEntry(TypedDict):
    """One shard as metadata.json lists it."""

    file: str
    tokens: int
    max_id: int  # largest token id in the shard (-1 when empty)


class SplitSummary(TypedDict):
    """One split as metadata.json records it (prepare-data adds its per-kind counts)."""

    tokens: int
    documents: int
    shards: list[ShardEntry]


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.npy"


def _npy_header(dtype: np.dtype[np.generic], length: int) -> bytes:
    body = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)})
    magic = b"\x93NUMPY\x01\x00"
    pad = _HEADER_BYTES - len(magic) - 2 - len(body) - 1
    return magic + struct.pack("<H", _HEADER_BYTES - len(magic) - 2) + body.encode("latin1") + b" " * pad + b"\n"


def copy_range(src_fd: int, src_offset: int, dst_fd: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src_fd`` at ``src_offset`` to ``dst_fd``'s position (in the kernel when it can)."""
    while nbytes > 0:
        try:
            n = os.copy_file_range(src_fd, dst_fd, nbytes, src_offset)
        except (AttributeError, OSError):  # no copy_file_range here (other OS, other filesystem)
            n = os.write(dst_fd, os.pread(src_fd, min(nbytes, 1 << 23), src_offset))
        if n <= 0:
            raise OSError(f"short copy: {nbytes} bytes left")
        src_offset += n
        nbytes -= n


class NpyStreamWriter:
    """Append 1-D chunks to a `.npy` file whose final length is unknown up front."""

    def __init__(self, path: Path, dtype: np.dtype[np.generic]) -> None:
        self.path = path
        self.dtype = dtype
        self.length = 0
        self._f: BinaryIO = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._f.write(_npy_header(dtype, 0))

    def append(self, tokens: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.length += len(tokens)

    def copy_from(self, fd: int, byte_offset: int, length: int) -> None:
        """Append ``length`` tokens stored raw (this dtype) in file ``fd`` at ``byte_offset``."""
        copy_range(fd, byte_offset, self._f.fileno(), length * self.dtype.itemsize)
        self.length += length

    def close(self) -> None:
        self._f.seek(0)
        self._f.write(_npy_header(self.dtype, self.length))
        self._f.close()


class SplitWriter:
    """Writes one split as shards of at most ``shard_tokens`` tokens; counts documents (EOS ids)."""

    def __init__(self, root: Path, split: str, dtype: np.dtype[np.generic], shard_tokens: int, eos_id: int) -> None:
        self.root, self.split, self.dtype = root, split, dtype
        self.shard_tokens, self.eos_id = shard_tokens, eos_id
        self.shards: list[ShardEntry] = []
        self.tokens = 0
        self.documents = 0
        self._cur: NpyStreamWriter | None = None

    def _shard(self) -> NpyStreamWriter:
        if self._cur is None:
            self._cur = NpyStreamWriter(self.root / shard_name(self.split, len(self.shards)), self.dtype)
        return self._cur

    def append(self, tokens: np.ndarray) -> None:
        self.tokens += len(tokens)
        self.documents += int(np.count_nonzero(tokens == self.eos_id))
        while len(tokens):
            cur = self._shard()
            room = self.shard_tokens - cur.length
            cur.append(tokens[:room])
            tokens = tokens[room:]
            if cur.length >= self.shard_tokens:
                self._finish_shard()

    def copy_from(self, fd: int, byte_offset: int, length: int, documents: int) -> None:
        """Append ``length`` raw tokens from file ``fd`` (a worker's part file) holding ``documents`` EOS."""
        self.tokens += length
        self.documents += documents
        while length:
            cur = self._shard()
            take = min(length, self.shard_tokens - cur.length)
            cur.copy_from(fd, byte_offset, take)
            byte_offset += take * self.dtype.itemsize
            length -= take
            if cur.length >= self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        assert self._cur is not None
        self._cur.close()
        written = np.load(self._cur.path, mmap_mode="r", allow_pickle=False)  # hot in the page cache
        top = shard_max_id(written) if written.shape[0] else -1
        self.shards.append({"file": self._cur.path.name, "tokens": self._cur.length, "max_id": top})
        self._cur = None

    def close(self) -> SplitSummary:
        if self._cur is not None:
            self._finish_shard()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    tokens: int
    max_id: int = -1  # largest token id in the shard (checked against the vocabulary when opened)


@dataclass(frozen=True)
class PreparedMeta:
    """metadata.json of a prepared directory, checked against the shards on disk."""

    root: Path
    tokenizer: dict[str, object]  # as metadata.json holds it: read with isinstance checks
    vocab_size: int
    eos_id: int
    dtype: np.dtype[np.generic]
    splits: dict[str, list[ShardInfo]]
    raw: dict[str, object]

    def split_tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits.get(split, []))


def _bad(root: Path, what: str) -> InvalidInputError:
    return InvalidInputError(f"prepared data directory {root}: {what}; re-run `kforge prepare-data` to rebuild it")


def read_metadata(root: Path) -> dict[str, object]:
    """Parse DIR/metadata.json, or fail saying the directory is not prepared data."""
    path = root / METADATA
    if not root.is_dir():
        raise InvalidInputError(f"data directory {root} does not exist; create it with `kforge prepare-data`")
    if not path.is_file():
        raise InvalidInputError(f"{root} has no {METADATA}: it is not a directory made by `kforge prepare-data`")
    try:
        meta: object = json.loads(read_text_capped(path, MAX_METADATA_BYTES, "metadata"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, InvalidInputError) as exc:
        raise _bad(root, f"{METADATA} is unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(root, f"{METADATA} is not kforge token metadata (format != {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise _bad(root, f"format_version {meta.get('format_version')} is not supported (expected {FORMAT_VERSION})")
    return meta


def _shard_path(root: Path, entry: object) -> tuple[Path, int, int | None]:
    """(path, tokens, cached max id) of one ``shards`` entry; its file must be a plain name inside `root`."""
    if not isinstance(entry, dict):
        raise _bad(root, f"a shard entry in {METADATA} is {entry!r}, not an object")
    name, tokens, max_id = entry.get("file"), entry.get("tokens"), entry.get("max_id")
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise _bad(root, f"{METADATA} names the shard {name!r}; shards must be plain file names inside the directory")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise _bad(root, f"shard {name}: token count {tokens!r} is not an integer >= 0")
    if max_id is not None and (isinstance(max_id, bool) or not isinstance(max_id, int)):
        raise _bad(root, f"shard {name}: max_id {max_id!r} is not an integer")
    if max_id is not None and (max_id < -1 or (max_id == -1) != (tokens == 0)):
        # -1 means empty: on a non-empty shard it would switch off the check of every read (tokens.py)
        raise _bad(root, f"shard {name}: max_id {max_id} does not fit its {tokens} tokens")
    path = root / name
    if path.is_symlink() and not path.resolve().is_relative_to(root):
        raise _bad(root, f"shard {name} is a link to {path.resolve()}, outside the directory")
    return path, tokens, max_id


def shard_max_id(arr: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest token id of a shard (vectorised, in chunks so a memory-mapped shard is not copied whole)."""
    top = -1
    for start in range(0, arr.shape[0], chunk):
        top = max(top, int(arr[start : start + chunk].max()))
    return top


def _check_shard(
    root: Path, path: Path, tokens: int, max_id: int | None, dtype: np.dtype[np.generic], vocab: int
) -> int:
    if not path.is_file():
        raise _bad(root, f"shard {path.name} listed in {METADATA} is missing")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise _bad(root, f"shard {path.name} is unreadable ({exc})") from exc
    if arr.dtype != dtype or arr.shape != (tokens,):
        raise _bad(root, f"shard {path.name} holds {arr.dtype}{list(arr.shape)} but {METADATA} says {dtype}[{tokens}]")
    top = shard_max_id(arr) if max_id is None else max_id  # prepare-data caches it; older directories are scanned
    if top >= vocab:
        raise _bad(root, f"shard {path.name} holds token id {top}, outside the vocabulary of {vocab} ids")
    return top


def _dtype_name(value: object) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(f"dtype {value!r} is not a dtype name")


def load_prepared(root: str | Path) -> PreparedMeta:
    """Read metadata.json and check every shard: a plain name inside DIR, its dtype, length and token range."""
    root = Path(root).expanduser().resolve()
    meta = read_metadata(root)
    for key in ("vocab_size", "eos_id"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(root, f"{METADATA}: {key} is {str(value)[:40]!r}, not a whole number")
    try:
        vocab, eos = int_of(meta["vocab_size"]), int_of(meta["eos_id"])
        dtype = np.dtype(_dtype_name(meta["dtype"]))
        split_meta = meta["splits"]
        tokenizer = meta["tokenizer"]
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(root, f"{METADATA} lacks or has a bad field: {exc}") from exc
    if not isinstance(split_meta, dict) or not isinstance(tokenizer, dict):
        raise _bad(root, f"{METADATA}: 'splits' and 'tokenizer' must be objects")
    if vocab <= 0 or dtype.kind != "u" or vocab - 1 > np.iinfo(dtype).max:
        raise _bad(root, f"dtype {dtype} cannot hold a vocabulary of {vocab}")
    splits: dict[str, list[ShardInfo]] = {}
    for split, info in split_meta.items():
        if not isinstance(info, dict) or not isinstance(info.get("shards", []), list):
            raise _bad(root, f"{METADATA}: split {split!r} is {info!r}, not an object with a list of shards")
        shards = []
        for entry in info.get("shards", []):
            path, tokens, max_id = _shard_path(root, entry)
            top = _check_shard(root, path, tokens, max_id, dtype, vocab)
            shards.append(ShardInfo(path, tokens, top))
        total = info.get("tokens", -1)
        if isinstance(total, bool) or not isinstance(total, int) or sum(s.tokens for s in shards) != total:
            raise _bad(root, f"split {split!r}: shard lengths do not add up to its token count {total!r}")
        splits[split] = shards
    if not splits.get("train"):
        raise _bad(root, "it has no train split")
    return PreparedMeta(root, tokenizer, vocab, eos, dtype, splits, meta)
