"""prepare-data inputs: which files, how they are cut into segments, and which segments are val.

Every input file is cut into *segments* of a fixed number of bytes ``S`` (4 KiB to
1 MiB, from the total input size), each moved to the next line start so no line (or
JSONL record) is split. Segments are the unit of the train/val split: an evenly
spread ``val_fraction`` of them (at least one when there are two or more) go to val,
so even a single text file yields a validation split. Consecutive segments of one
file are grouped into *work units* for the worker processes; the output does not
depend on the number of workers. A local Hugging Face dataset (see :mod:`hf_source`)
is cut into segments of records instead, by the same rule, and its units are record
ranges.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from kforge_cli.engine.data.prepare import hf_source
from kforge_cli.engine.data.prepare.hf_source import HFDataset
from kforge_cli.errors import InvalidInputError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
MAX_TEXT_SCAN = 1 << 20  # a text line longer than this may be cut (at a character boundary)
MAX_UNIT_BYTES = 8 << 20

Kind = Literal["text", "jsonl", "hf"]


@dataclass(frozen=True)
class InputFile:
    index: int
    path: Path
    size: int
    mtime_ns: int
    kind: Kind
    hf: HFDataset | None = None  # set when kind == "hf"


@dataclass(frozen=True)
class WorkUnit:
    """Segments ``first .. first + len(splits) - 1`` of one file, with each segment's split.

    For a Hugging Face dataset: records ``first_record .. first_record + num_records - 1``,
    in segments of ``segment_records`` (the first and last may be partly outside the unit).
    """

    file: InputFile
    first_segment: int  # index within the file
    global_segment: int  # index of the first segment over all files
    segment_bytes: int
    splits: tuple[str, ...]
    text_field: str
    skip_bad_records: bool
    first_record: int = 0
    num_records: int = 0
    segment_records: int = 0


def _kind(path: Path) -> Kind:
    return "jsonl" if path.suffix.lower() in JSONL_SUFFIXES else "text"


def _walk(directory: Path) -> list[Path]:
    """Files under ``directory``, sorted; a save_to_disk directory inside is one input, not walked."""
    found = []
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        if here != directory and hf_source.is_dataset_dir(here):
            found.append(here)
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [here / f for f in sorted(files) if not f.startswith(".")]
    return found


def _hf_input(spec: Path, index: int, hf_split: str | None) -> InputFile:
    ds = hf_source.resolve(spec, hf_split)
    return InputFile(index, ds.root, ds.size, ds.mtime_ns, "hf", ds)


def collect_inputs(
    paths: list[Path], skip_bad_records: bool, exclude: Path | None = None, hf_split: str | None = None
) -> tuple[list[InputFile], list[str]]:
    """Files to read (directories walked, hidden files skipped) and the empty files skipped.

    A missing path, an unreadable file, or (without --skip-bad-records) an empty file or
    dataset is an error naming it. Files under ``exclude`` (the output directory) are
    ignored. Hugging Face datasets (``hf:PATH``, save_to_disk directories, .parquet and
    .arrow files) are resolved by :func:`hf_source.resolve` with ``hf_split``.
    """
    files: list[Path] = []
    for p in paths:
        p = p if str(p).startswith(hf_source.HF_PREFIX) else p.expanduser()
        if hf_source.is_hf_input(p):
            files.append(p)
        elif p.is_dir():
            inside = _walk(p)
            if not inside:
                raise InvalidInputError(f"input directory {p} contains no files")
            files += inside
        elif p.is_file():
            files.append(p)
        else:
            raise InvalidInputError(
                f"input {p} does not exist (give text or JSONL files, directories, or local Hugging Face datasets)"
            )
    out: list[InputFile] = []
    skipped: list[str] = []
    seen: set[Path] = set()
    for f in files:
        if hf_source.is_hf_input(f):
            hf = _hf_input(f, len(out), hf_split)
            if hf.path in seen or (exclude is not None and hf.path.is_relative_to(exclude)):
                continue
            seen.add(hf.path)
            if hf.hf is not None and hf.hf.rows == 0:
                if not skip_bad_records:
                    raise InvalidInputError(
                        f"dataset {hf.hf.name} has no records (remove it, or pass --skip-bad-records to skip it)"
                    )
                skipped.append(hf.hf.name)
                continue
            out.append(hf)
            continue
        f = f.resolve()
        if f in seen or (exclude is not None and f.is_relative_to(exclude)):
            continue
        seen.add(f)
        try:
            st = f.stat()
            with open(f, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise InvalidInputError(f"input {f} is unreadable: {exc.strerror or exc}") from exc
        if st.st_size == 0:
            if skip_bad_records:
                skipped.append(str(f))
                continue
            raise InvalidInputError(f"input {f} is empty (remove it, or pass --skip-bad-records to skip it)")
        out.append(InputFile(len(out), f, st.st_size, st.st_mtime_ns, _kind(f)))
    if not out:
        raise InvalidInputError("no non-empty input files were given")
    return out, skipped


def segment_bytes_for(total_bytes: int) -> int:
    """Power of two near total/2048, within [4 KiB, 1 MiB]."""
    return 1 << max(12, min(20, max(total_bytes // 2048, 1).bit_length()))


def val_segments(num_segments: int, val_fraction: float) -> set[int]:
    """An evenly spread ``val_fraction`` of segment indices (>= 1 when there are >= 2 segments)."""
    if val_fraction <= 0 or num_segments < 2:
        return set()
    n_val = min(num_segments - 1, max(1, round(val_fraction * num_segments)))
    return {int((i + 0.5) * num_segments / n_val) for i in range(n_val)}


def plan_units(
    files: list[InputFile],
    *,
    val_fraction: float,
    workers: int,
    text_field: str,
    skip_bad_records: bool,
) -> list[WorkUnit]:
    """Cut every file into segments, choose val segments, and group them into work units."""
    total = sum(f.size for f in files)
    seg = segment_bytes_for(total)
    per_seg = [hf_source.records_per_segment(f.hf, seg) if f.hf else 0 for f in files]
    counts = [-(-f.hf.rows // r) if f.hf else -(-f.size // seg) for f, r in zip(files, per_seg, strict=True)]
    val = val_segments(sum(counts), val_fraction)
    # ~4 units per worker for load balance, whole segments, at most MAX_UNIT_BYTES
    unit_segments = max(1, min(MAX_UNIT_BYTES // seg, total // (seg * 4 * max(workers, 1))))
    units: list[WorkUnit] = []
    base = 0
    for f, n, r in zip(files, counts, per_seg, strict=True):
        if f.hf is not None:  # record ranges; a segment's split follows from its global index alone
            for a, b in hf_source.unit_ranges(f.hf, unit_segments * r):
                s0, s1 = a // r, (b - 1) // r + 1
                splits = tuple("val" if base + s in val else "train" for s in range(s0, s1))
                units.append(WorkUnit(f, s0, base + s0, seg, splits, text_field, skip_bad_records, a, b - a, r))
        else:
            for first in range(0, n, unit_segments):
                k = min(unit_segments, n - first)
                splits = tuple("val" if base + first + i in val else "train" for i in range(k))
                units.append(WorkUnit(f, first, base + first, seg, splits, text_field, skip_bad_records))
        base += n
    return units


def cut(fh: BinaryIO, pos: int, size: int, kind: Kind) -> int:
    """The first line start at or after byte ``pos``: where a segment boundary really falls.

    Every unit computes its boundaries from the file bytes alone, so the unit ending at
    ``pos`` and the unit starting there agree. A text line longer than MAX_TEXT_SCAN is
    cut at a UTF-8 character boundary instead (a JSONL record is never cut).
    """
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    fh.seek(pos - 1)
    scanned, step = 0, 4096
    while kind == "jsonl" or scanned < MAX_TEXT_SCAN:
        chunk = fh.read(step)
        if not chunk:
            return size
        i = chunk.find(b"\n")
        if i >= 0:
            return pos - 1 + scanned + i + 1
        scanned += len(chunk)
        step = 1 << 16
    lo = max(0, pos - 3)
    fh.seek(lo)
    head = fh.read(pos - lo + 1)
    k = pos - lo
    while k > 0 and 0x80 <= head[k] < 0xC0:  # a UTF-8 continuation byte: back off to the character start
        k -= 1
    return lo + k


def line_number(path: Path, offset: int) -> int:
    """1-based line number of byte ``offset`` (only used to word an error)."""
    count, done = 1, 0
    with open(path, "rb") as fh:
        while done < offset:
            block = fh.read(min(1 << 20, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count
