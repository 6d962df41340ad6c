"""The prepare-data worker: read one work unit's segments, validate them, tokenize them.

Runs in a pool of spawned processes (or inline for small jobs). It imports numpy and
tokenizers, never torch. The tokens go to a raw *part file* next to the output (the
main process copies them into the shards in the kernel), not back through a pipe:
pickling hundreds of MB of arrays through the pool costs more than tokenizing them.
Errors are :class:`InvalidInputError` naming the file and line; with
``--skip-bad-records`` a bad JSONL record or a text line with invalid UTF-8 is
dropped and counted instead. A Hugging Face dataset unit (a record range, see
:mod:`hf_source`) is handled the same way, its errors naming the dataset and record index.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from kforge_cli.engine.data.prepare import hf_source
from kforge_cli.engine.data.prepare.inputs import WorkUnit, cut, line_number
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kforge_cli.errors import InvalidInputError

MAX_EXAMPLES = 3  # skipped records quoted in the summary

_TOKENIZER: ByteTokenizer | HFTokenizer | None = None


def init_worker(tokenizer_spec: str) -> None:
    """Pool initializer: load the tokenizer once per process, single-threaded."""
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER = load_tokenizer(tokenizer_spec)


@dataclass
class SegmentResult:
    """Where one segment's tokens are in the part file.

    JSONL and Hugging Face datasets: every record followed by EOS; text: a piece of one
    document, no EOS.
    """

    split: str
    kind: str
    file_index: int
    start: int  # token offset in the part file
    length: int  # tokens
    documents: int = 0  # EOS ids among them
    records: int = 0  # JSONL records tokenized
    text_bytes: int = 0  # UTF-8 bytes of the text tokenized (no EOS): bits per byte = loss / ln 2 * tokens / bytes


@dataclass
class UnitResult:
    part: str
    segments: list[SegmentResult]
    bytes_read: int
    skipped: int = 0
    examples: list[str] = field(default_factory=list)


class _Bad:
    """Collects skipped records, or raises when skipping is off."""

    def __init__(self, unit: WorkUnit, result: UnitResult) -> None:
        self.unit, self.result = unit, result

    def _where(self, offset: int) -> str:
        f = self.unit.file
        return f"dataset {f.hf.name} record {offset}" if f.hf else f"{f.path} line {line_number(f.path, offset)}"

    def __call__(self, offset: int, what: str, hint: str) -> None:
        """A bad record at byte ``offset`` of the file (the record index of a dataset)."""
        if not self.unit.skip_bad_records:
            raise InvalidInputError(f"{self._where(offset)}: {what}; {hint}")
        self.result.skipped += 1
        if len(self.result.examples) < MAX_EXAMPLES:
            self.result.examples.append(f"{self._where(offset)}: {what}")


def _text(raw: bytes, offset: int, bad: _Bad) -> bytes:
    """``raw`` without its lines of invalid UTF-8 (each one reported to ``bad``)."""
    pieces: list[bytes] = []
    while True:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            start = raw.rfind(b"\n", 0, exc.start) + 1
            end = raw.find(b"\n", exc.start)
            end = len(raw) if end < 0 else end + 1
            bad(
                offset + exc.start,
                f"invalid UTF-8 at byte {offset + exc.start}",
                "fix the encoding or pass --skip-bad-records to drop such lines",
            )
            pieces.append(raw[:start])
            raw, offset = raw[end:], offset + end
            continue
        pieces.append(raw)
        return b"".join(pieces)


def _records(raw: bytes, offset: int, text_field: str, bad: _Bad) -> list[str]:
    """The text field of every JSONL record in ``raw`` (blank lines are not records)."""
    texts: list[str] = []
    pos = 0
    for line in raw.split(b"\n"):
        at, pos = offset + pos, pos + len(line) + 1
        if not line.strip():
            continue
        try:
            record: object = json.loads(line)
        except UnicodeDecodeError:
            bad(at, "invalid UTF-8", "fix the encoding or pass --skip-bad-records")
            continue
        except ValueError as exc:
            bad(at, f"invalid JSON ({exc})", "fix the record or pass --skip-bad-records")
            continue
        except RecursionError:  # e.g. 200k nested arrays: not a document
            bad(at, "JSON nested too deeply to parse", "fix the record or pass --skip-bad-records")
            continue
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            bad(at, f"record has no field {text_field!r} (has: {keys})", "use --text-field or --skip-bad-records")
            continue
        text = record[text_field]
        if not isinstance(text, str):
            bad(at, f"field {text_field!r} is {type(text).__name__}, not a string", "pass --skip-bad-records")
            continue
        if not _encodable(text):
            bad(
                at,
                f"field {text_field!r} holds a lone surrogate (e.g. \\ud800), not valid Unicode",
                "pass --skip-bad-records",
            )
            continue
        if text:
            texts.append(text)
    return texts


def _encodable(text: str) -> bool:
    """False when `text` holds a lone surrogate (JSON allows "\\ud800"; UTF-8 and tokenizers do not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _segment_tokens(
    unit: WorkUnit, raw: bytes, offset: int, bad: _Bad, dtype: np.dtype[np.generic]
) -> tuple[np.ndarray, int, int]:
    """(tokens, JSONL records, UTF-8 bytes of the text) of one segment."""
    tok = _TOKENIZER
    assert tok is not None, "init_worker was not called"
    if unit.file.kind == "text":
        text = _text(raw, offset, bad)
        return tok.encode_bytes(text, dtype), 0, len(text)
    texts = _records(raw, offset, unit.text_field, bad)
    docs = tok.encode_batch(texts, dtype)
    eos = np.array([tok.eos_id], dtype=dtype)
    parts = [p for d in docs for p in (d, eos)]
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    return tokens, len(docs), _utf8_bytes(texts)


def _utf8_bytes(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def _dataset_texts(records: hf_source.Records, field: str, bad: _Bad) -> list[str]:
    """The non-empty texts of ``records`` (a null, missing or non-string value is a bad record)."""
    if records.values is None:
        has = ", ".join(records.columns)
        for i in range(records.start, records.stop):
            bad(i, f"record has no field {field!r} (has: {has})", "use --text-field or --skip-bad-records")
        return []
    texts: list[str] = []
    for i, text in enumerate(records.values, records.start):
        if text is None:
            bad(i, f"field {field!r} is null", "fill it or pass --skip-bad-records")
        elif not isinstance(text, str):
            bad(i, f"field {field!r} is {type(text).__name__}, not a string", "pass --skip-bad-records")
        elif text:
            texts.append(text)
    return texts


def _encode_records(unit: WorkUnit, dtype: np.dtype[np.generic], part: str) -> UnitResult:
    """A Hugging Face dataset unit: one SegmentResult per piece of records within one segment."""
    tok, ds = _TOKENIZER, unit.file.hf
    assert tok is not None and ds is not None, "init_worker was not called, or not a dataset unit"
    end = unit.first_record + unit.num_records
    result = UnitResult(part=part, segments=[], bytes_read=hf_source.bytes_between(ds, unit.first_record, end))
    bad = _Bad(unit, result)
    eos = np.array([tok.eos_id], dtype=dtype)
    written = 0
    with open(part, "wb") as out:
        for records in hf_source.read_column(
            ds, unit.text_field, unit.first_record, unit.num_records, unit.segment_records
        ):
            texts = _dataset_texts(records, unit.text_field, bad)
            docs = tok.encode_batch(texts, dtype)
            if not docs:
                continue
            tokens = np.concatenate([p for d in docs for p in (d, eos)])
            out.write(tokens.tobytes())
            split = unit.splits[records.start // unit.segment_records - unit.first_segment]
            result.segments.append(
                SegmentResult(
                    split, "hf", unit.file.index, written, len(tokens), len(docs), len(docs), _utf8_bytes(texts)
                )
            )
            written += len(tokens)
    return result


def encode_unit(unit: WorkUnit, dtype_name: str, part: str) -> UnitResult:
    """Tokenize one work unit's segments into the raw file ``part`` (see :mod:`inputs` for segments)."""
    dtype = np.dtype(dtype_name)
    if unit.file.hf is not None:
        return _encode_records(unit, dtype, part)
    f = unit.file
    result = UnitResult(part=part, segments=[], bytes_read=0)
    bad = _Bad(unit, result)
    written = 0
    with open(f.path, "rb") as fh, open(part, "wb") as out:
        bounds = [
            cut(fh, (unit.first_segment + i) * unit.segment_bytes, f.size, f.kind) for i in range(len(unit.splits) + 1)
        ]
        fh.seek(bounds[0])
        for i, split in enumerate(unit.splits):
            raw = fh.read(bounds[i + 1] - bounds[i])
            result.bytes_read += len(raw)
            tokens, records, text_bytes = _segment_tokens(unit, raw, bounds[i], bad, dtype)
            out.write(tokens.tobytes())
            result.segments.append(
                SegmentResult(split, f.kind, f.index, written, len(tokens), records, records, text_bytes)
            )
            written += len(tokens)
    return result
