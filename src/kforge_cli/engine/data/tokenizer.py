"""Tokenizers: the built-in byte tokenizer and Hugging Face `tokenizer.json` files.

Nothing is downloaded at run time: a Hugging Face tokenizer is a local JSON file given
by path. Every tokenizer has one end-of-sequence id (``eos_id``) that prepare-data
appends after each document; document masking finds boundaries through it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np

from kforge_cli.errors import InvalidInputError

# Special tokens recognised as the end-of-document marker, in order of preference.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


class Tokenizer(Protocol):
    """What the data layer (and sampling code) needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_bytes(self, data: bytes, dtype: np.dtype[np.generic]) -> np.ndarray:
        """Tokenize UTF-8 ``data`` (already validated) straight into an array of ``dtype``."""
        ...

    def encode_batch(self, texts: list[str], dtype: np.dtype[np.generic]) -> list[np.ndarray]:
        """Tokenize several documents (JSONL records) into arrays of ``dtype``."""
        ...

    def describe(self) -> dict[str, object]:
        """JSON-able identity written to metadata.json (kind, checksum, sizes)."""
        ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes, 256 is EOS: no files, no training, vocab 257."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def encode_bytes(self, data: bytes, dtype: np.dtype[np.generic]) -> np.ndarray:
        # UTF-8 bytes are the ids: a widening copy, no Python loop.
        return np.frombuffer(data, dtype=np.uint8).astype(dtype)

    def encode_batch(self, texts: list[str], dtype: np.dtype[np.generic]) -> list[np.ndarray]:
        return [self.encode_bytes(t.encode("utf-8"), dtype) for t in texts]

    def describe(self) -> dict[str, object]:
        return {"kind": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file.

    The EOS id is the first of :data:`EOS_CANDIDATES` the file defines; a file without
    any gets one extra id (``vocab_size`` of the file) as its document separator.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        self.path = Path(path).expanduser().resolve()
        if not self.path.is_file():
            raise InvalidInputError(f"tokenizer file {self.path} does not exist; give 'byte' or a tokenizer.json path")
        try:
            raw = self.path.read_bytes()
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # OSError, UnicodeDecodeError, tokenizers' Exception and Rust panics
            raise InvalidInputError(
                f"tokenizer file {self.path} does not parse as a Hugging Face tokenizer.json: {exc}"
            ) from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.name = self.path.name
        base = self._tok.get_vocab_size(with_added_tokens=True)
        eos = next((i for t in EOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None)
        self.eos_token: str | None = None if eos is None else self._tok.id_to_token(eos)
        self.eos_id = base if eos is None else eos
        self.vocab_size = base + 1 if eos is None else max(base, self.eos_id + 1)

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a Rust panic (pyo3's PanicException is a BaseException) in its regexes
            raise InvalidInputError(
                f"tokenizer file {self.path} failed on the text ({type(exc).__name__}: {exc})"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i != self.eos_id or self.eos_token is not None])

    def encode_bytes(self, data: bytes, dtype: np.dtype[np.generic]) -> np.ndarray:
        return np.asarray(self.encode(data.decode("utf-8")), dtype=dtype)

    def encode_batch(self, texts: list[str], dtype: np.dtype[np.generic]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=dtype) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def describe(self) -> dict[str, object]:
        return {
            "kind": "hf",
            "file": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """``'byte'`` or a path to a ``tokenizer.json``."""
    if str(spec) == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def token_dtype(vocab_size: int) -> np.dtype[np.generic]:
    """The smallest unsigned dtype holding every id below ``vocab_size``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)
