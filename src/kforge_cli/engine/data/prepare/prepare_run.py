"""`kforge prepare-data`: text, directories, JSONL and local HF datasets -> token shards + metadata.json.

Streaming and parallel: work units (a few MiB of one file) are tokenized by a pool of
processes, at most ``2 * workers`` in flight, each into a raw part file; the main
process copies the parts in input order into the shards of their split and deletes
them, so memory and scratch space stay flat however large the input.
Source checksums are computed by a thread alongside. Everything is written to a
hidden temporary directory next to ``--out``, fsynced and renamed into place at the end
(:mod:`output_dir`): an interrupted run never leaves a directory that looks complete. Re-running with the
same inputs (path, size, mtime), tokenizer and options finds the finished directory
and does nothing. A local Hugging Face dataset is one more kind of input
(:mod:`hf_source`): its records become documents exactly like JSONL records, and
training reads the result like any other prepared directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from kforge_cli.common.files import fsync_dir
from kforge_cli.common.json_values import dict_of, int_of
from kforge_cli.common.prepare_defaults import (
    PREPARE_SHARD_TOKENS,
    PREPARE_TEXT_FIELD,
    PREPARE_TOKENIZER,
    PREPARE_VAL_FRACTION,
)
from kforge_cli.engine.data.prepare import hf_source
from kforge_cli.engine.data.prepare.encode_worker import SegmentResult, UnitResult, encode_unit, init_worker
from kforge_cli.engine.data.prepare.inputs import InputFile, WorkUnit, collect_inputs, plan_units
from kforge_cli.engine.data.prepare.output_dir import check_out, fsync_tree, replace_dir, sigterm_cleans_up
from kforge_cli.engine.data.shards import FORMAT, FORMAT_VERSION, METADATA, SplitSummary, SplitWriter, load_prepared
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, token_dtype
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.data_check import TOKENIZER_FILE


@dataclass
class PrepareResult:
    out: Path
    reused: bool  # the directory was already up to date: nothing was done
    tokens: dict[str, int]
    documents: dict[str, int]
    input_bytes: int
    seconds: float
    workers: int
    skipped_records: int
    skipped_files: int
    dtype: str
    vocab_size: int
    documents_by_kind: dict[str, dict[str, int]] | None = None  # split -> DOCUMENT_KINDS key -> documents
    text_files: int | None = None  # text files that hold at least one document

    @property
    def tokens_per_second(self) -> float:
        return sum(self.tokens.values()) / self.seconds if self.seconds > 0 else 0.0


# What one document (one EOS-terminated run of tokens) is, per input kind: metadata.json
# records this, and the summary line counts by it.
DOCUMENT_KINDS = {
    "text": "a text file, whole; when the val split takes lines from it, each contiguous piece of "
    "the file within one split is one document",
    "jsonl": "one JSONL record (its text field; blank lines and empty texts are not documents)",
    "hf": "one dataset row (its text column; empty texts are not documents)",
}


class _Assembler:
    """Routes segment tokens to their split and puts one EOS after every document.

    A text file is one document whose segments may alternate between splits: a split
    closes its open document (EOS) when the next piece comes from another file, or when
    the file's preceding piece went to the other split (a discontinuity), so each
    contiguous piece of a file within a split is one document (see DOCUMENT_KINDS).
    JSONL and dataset pieces are whole records that already end with EOS. Documents are
    counted per split and kind as they are closed: the counts equal the EOS ids written.
    """

    def __init__(self, writers: dict[str, SplitWriter], eos_id: int, dtype: np.dtype[np.generic]) -> None:
        self.writers, self.eos = writers, np.array([eos_id], dtype=dtype)
        self.open_doc: dict[str, int | None] = dict.fromkeys(writers)
        self.last_split: str | None = None
        self.records = 0
        self.by_kind = {split: dict.fromkeys(DOCUMENT_KINDS, 0) for split in writers}
        self.text_bytes = dict.fromkeys(writers, 0)
        self.text_files: set[int] = set()

    def _close(self, split: str) -> None:
        if self.open_doc[split] is not None:
            self.writers[split].append(self.eos)
            self.by_kind[split]["text"] += 1
            self.open_doc[split] = None

    def add(self, seg: SegmentResult, part_fd: int, itemsize: int) -> None:
        self.records += seg.records
        self.text_bytes[seg.split] += seg.text_bytes
        if not seg.length:
            return
        if seg.kind != "text" or (
            self.open_doc[seg.split] is not None
            and (self.open_doc[seg.split] != seg.file_index or self.last_split != seg.split)
        ):
            self._close(seg.split)
        self.writers[seg.split].copy_from(part_fd, seg.start * itemsize, seg.length, seg.documents)
        if seg.kind == "text":
            self.open_doc[seg.split] = seg.file_index
            self.text_files.add(seg.file_index)
        else:
            self.by_kind[seg.split][seg.kind] += seg.documents
        self.last_split = seg.split

    def finish(self) -> None:
        for split in self.writers:
            self._close(split)


def _kforge_version() -> str:
    try:
        return importlib.metadata.version("kforge")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _source_sha256(f: InputFile) -> str:
    return hf_source.sha256(f.hf) if f.hf else _sha256(f.path)


class SplitRecord(SplitSummary):
    """One split in metadata.json: the writer's summary plus what the assembler counted."""

    documents_by_kind: dict[str, int]
    text_bytes: int


def _inputs_key(files: list[InputFile], tokenizer: dict[str, object], options: dict[str, object]) -> str:
    ident = {
        "format_version": FORMAT_VERSION,
        "files": [[str(f.path), f.size, f.mtime_ns, f.kind] + ([f.hf.key] if f.hf else []) for f in files],
        "tokenizer": tokenizer,
        "options": options,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _recorded_key(out: Path) -> str | None:
    """The inputs key of the prepared directory at `out` (None when there is none to read)."""
    try:
        key = json.loads((out / METADATA).read_text(encoding="utf-8")).get("inputs_key")
    except (OSError, ValueError, AttributeError):
        return None
    return key if isinstance(key, str) else None


def _up_to_date(out: Path, key: str) -> bool:
    meta_path = out / METADATA
    if not meta_path.is_file():
        return False
    try:
        if json.loads(meta_path.read_text(encoding="utf-8")).get("inputs_key") != key:
            return False
        load_prepared(out)  # every shard present with the recorded dtype and length
    except (InvalidInputError, OSError, ValueError):
        return False
    return True


def _ordered_map(units: list[WorkUnit], dtype: str, workers: int, tokenizer: str, parts: Path) -> Iterator[UnitResult]:
    """encode_unit over units in order, with at most 2 * workers units in flight."""
    jobs = ((u, dtype, str(parts / f"unit-{i:07d}.bin")) for i, u in enumerate(units))
    if workers <= 1:
        init_worker(tokenizer)
        for job in jobs:
            yield encode_unit(*job)
        return
    # spawn: never fork a process that may hold threads or torch state. A worker that dies
    # (OOM killer) makes .result() raise BrokenProcessPool instead of hanging.
    pool = ProcessPoolExecutor(
        workers, mp_context=mp.get_context("spawn"), initializer=init_worker, initargs=(tokenizer,)
    )
    try:
        pending: deque[Future[UnitResult]] = deque(pool.submit(encode_unit, *j) for j in islice(jobs, 2 * workers))
        while pending:
            result = pending.popleft().result()
            nxt = next(jobs, None)
            if nxt is not None:
                pending.append(pool.submit(encode_unit, *nxt))
            yield result
    finally:  # on an error or Ctrl-C: drop queued units, wait for the running ones (seconds at most)
        pool.shutdown(wait=True, cancel_futures=True)


def auto_workers(total_bytes: int, byte_level: bool) -> int:
    """All cores, but not more processes than the input keeps busy.

    Byte-level tokenization is a copy, faster in one process than the cost of starting
    workers for less than ~64 MiB each; a BPE tokenizer pays off from ~1 MiB each.
    """
    per_worker = (64 << 20) if byte_level else (1 << 20)
    return max(1, min(len(os.sched_getaffinity(0)), total_bytes // per_worker))


def prepare_data(
    inputs: list[Path],
    out: Path,
    *,
    tokenizer: str = PREPARE_TOKENIZER,
    val_fraction: float = PREPARE_VAL_FRACTION,
    shard_tokens: int = PREPARE_SHARD_TOKENS,
    text_field: str = PREPARE_TEXT_FIELD,
    skip_bad_records: bool = False,
    workers: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    hf_split: str | None = None,
    overwrite: bool = False,
) -> PrepareResult:
    """Tokenize ``inputs`` into ``out``; ``on_progress(bytes_done, bytes_total)`` after each unit.

    ``workers``: processes to tokenize with (None or 0 = :func:`auto_workers`).
    ``hf_split``: the split of a DatasetDict input (default ``train``, or its only split).
    ``overwrite``: replace a prepared directory at ``out`` that holds other data (refused without).
    """
    if not 0 <= val_fraction < 1:
        raise InvalidInputError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise InvalidInputError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    start = time.perf_counter()
    out = out.expanduser().resolve()
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    files, skipped_files = collect_inputs(list(inputs), skip_bad_records, exclude=out, hf_split=hf_split)
    options: dict[str, object] = {
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "skip_bad_records": skip_bad_records,
    }
    key = _inputs_key(files, tok.describe(), options)
    total = sum(f.size for f in files)
    workers = workers or auto_workers(total, isinstance(tok, ByteTokenizer))
    units = plan_units(
        files, val_fraction=val_fraction, workers=workers, text_field=text_field, skip_bad_records=skip_bad_records
    )
    workers = min(workers, len(units))
    if _up_to_date(out, key):
        prepared = load_prepared(out)
        meta = prepared.raw
        recorded = dict_of(meta["splits"], "splits")  # load_prepared checked each split's token count
        skipped_list = meta["skipped_files"]
        if not isinstance(skipped_list, list):
            raise TypeError(f"{METADATA}: skipped_files is {skipped_list!r}, not a list")
        return PrepareResult(
            out,
            True,
            {s: prepared.split_tokens(s) for s in recorded},
            {s: int_of(dict_of(v, s)["documents"]) for s, v in recorded.items()},
            total,
            time.perf_counter() - start,
            0,
            int_of(meta["skipped_records"]),
            len(skipped_list),
            prepared.dtype.name,
            prepared.vocab_size,
        )
    check_out(out, overwrite=overwrite or _recorded_key(out) == key)  # a damaged copy of these inputs: rebuilt
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    restore_sigterm = sigterm_cleans_up()  # before the directory exists: no moment leaves it behind
    try:
        tmp.mkdir()
        with ThreadPoolExecutor(1) as hasher:
            sums: list[Future[str]] = [hasher.submit(_source_sha256, f) for f in files]
            writers = {s: SplitWriter(tmp, s, dtype, shard_tokens, tok.eos_id) for s in ("train", "val")}
            asm = _Assembler(writers, tok.eos_id, dtype)
            done, skipped, examples = 0, 0, []
            parts = tmp / ".parts"
            parts.mkdir()
            spec = str(tok.path) if isinstance(tok, HFTokenizer) else "byte"
            for res in _ordered_map(units, dtype.name, workers, spec, parts):
                with open(res.part, "rb") as part:
                    for seg in res.segments:
                        asm.add(seg, part.fileno(), dtype.itemsize)
                os.unlink(res.part)
                done += res.bytes_read
                skipped += res.skipped
                examples += res.examples[: 3 - len(examples)]
                if on_progress:
                    on_progress(done, total)
            asm.finish()
            splits: dict[str, SplitRecord] = {
                s: SplitRecord(**w.close(), documents_by_kind=asm.by_kind[s], text_bytes=asm.text_bytes[s])
                for s, w in writers.items()
            }
            parts.rmdir()
            sources = [
                {"path": str(f.path), "kind": f.kind, "bytes": f.size, "sha256": s.result()}
                | (f.hf.describe() if f.hf else {})
                for f, s in zip(files, sums, strict=True)
            ]
        if splits["train"]["tokens"] == 0:
            raise InvalidInputError("the inputs contain no text to tokenize")
        if isinstance(tok, HFTokenizer):
            shutil.copyfile(tok.path, tmp / TOKENIZER_FILE)
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kforge_version": _kforge_version(),
            "tokenizer": tok.describe(),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": dtype.name,
            "document_separator": "the EOS id follows every document",
            "text_bytes": "per split: UTF-8 bytes of the text tokenized (no EOS); bits per byte = "
            "loss / ln(2) * tokens / text_bytes (kforge plot --bits-per-byte)",
            "documents": DOCUMENT_KINDS,
            "text_files": len(asm.text_files),
            "splits": splits,
            "sources": sources,
            "records": asm.records,
            "skipped_records": skipped,
            "skipped_examples": examples,
            "skipped_files": skipped_files,
            "options": options,
            "inputs_key": key,
        }
        (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        fsync_tree(tmp)
        replace_dir(tmp, out)
        fsync_dir(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        restore_sigterm()
    return PrepareResult(
        out,
        False,
        {s: v["tokens"] for s, v in splits.items()},
        {s: v["documents"] for s, v in splits.items()},
        total,
        time.perf_counter() - start,
        workers,
        skipped,
        len(skipped_files),
        dtype.name,
        tok.vocab_size,
        {s: v["documents_by_kind"] for s, v in splits.items()},
        len(asm.text_files),
    )
