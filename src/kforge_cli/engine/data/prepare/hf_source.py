"""Local Hugging Face datasets as prepare-data inputs: resolve them, plan record ranges, read a column.

A Hugging Face dataset is an *input* of ``kforge prepare-data``, like a text or JSONL
file, not a training-time stream: it is tokenized once into the same memory-mapped
shards and ``metadata.json``, and training reads that directory like any other. So
sharding across training ranks and loader workers is the existing exact, resumable
sample order (:mod:`kforge_cli.engine.data.sampler`): a resumed run continues at the
same window, which a streamed ``IterableDataset`` cannot promise.

Accepted (local only, never downloaded; ``HF_DATASETS_OFFLINE=1`` is set before
``datasets`` is imported):

- a ``Dataset.save_to_disk`` directory, or a ``DatasetDict`` one (split from
  ``--hf-split``, else ``train``, else its only split);
- ``.parquet`` or ``.arrow`` files, or ``hf:DIR`` for every such file under DIR (one format).

Inputs are found by their layout, or named explicitly as ``hf:PATH``; a name that is
not a local path (a Hub id, a URL) is refused with the way to download it first.

Sharding across prepare-data's worker processes: the records are cut into
*segments* of ``R`` records (about one byte segment of the on-disk data each; the
train/val unit, chosen by the same rule as text) and into *work units*, contiguous
record ranges (whole row groups for parquet, so no row group is decoded twice). Every
record lies in exactly one unit, and the output does not depend on the number of
workers. Reading is memory-mapped (Arrow, via ``datasets``) or streamed by row group
(parquet, via ``pyarrow``), only the text column, at most a segment at a time.
``datasets`` is imported lazily, only when such an input is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, NamedTuple, TypedDict

from kforge_cli.errors import InvalidInputError

HF_PREFIX = "hf:"
PARQUET, ARROW = ".parquet", ".arrow"
INSTALL_HINT = "pip install 'kforge[hf]'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_URL = re.compile(r"^[A-Za-z][\w+.-]*:/")  # scheme:// (a Path argument folds it to scheme:/)
_MAX_OPEN = 4  # datasets kept memory-mapped per process

Layout = Literal["save_to_disk", "arrow", "parquet"]


@dataclass(frozen=True)
class HFFile:
    """One backing file; ``row_groups`` holds the rows of each parquet row group."""

    path: Path
    size: int
    mtime_ns: int
    rows: int
    row_groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class HFDataset:
    """A local dataset resolved to its backing files (picklable: sent to the worker processes)."""

    name: str  # how messages name it: the path, plus the split of a DatasetDict
    root: Path
    layout: Layout
    split: str | None
    files: tuple[HFFile, ...]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def mtime_ns(self) -> int:
        return max((f.mtime_ns for f in self.files), default=0)

    @cached_property
    def key(self) -> str:
        """Identity for the inputs key: a changed, added or removed file rebuilds the output."""
        files = [[str(f.path), f.size, f.mtime_ns, f.rows] for f in self.files]
        return json.dumps([self.layout, self.split, files])

    def describe(self) -> HFSourceInfo:
        """What metadata.json records about this source besides path, bytes and checksum."""
        return {"format": self.layout, "split": self.split, "records": self.rows, "files": len(self.files)}


class HFSourceInfo(TypedDict):
    """What metadata.json records about a dataset input besides its path, bytes and checksum."""

    format: str
    split: str | None
    records: int
    files: int


class Records(NamedTuple):
    """Records ``start .. stop - 1``: their text-column values, or None when the column is missing."""

    start: int
    stop: int
    values: list[object] | None  # Arrow column values: the text column is checked record by record
    columns: tuple[str, ...]


def require_datasets(what: str) -> ModuleType:
    """``datasets``, imported offline, or an error saying how to install it."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # nothing here may reach the network
    try:
        import datasets
        import datasets.config
    except ImportError as exc:
        raise InvalidInputError(f"{what} is a Hugging Face dataset, which needs `datasets`: {INSTALL_HINT}") from exc
    datasets.config.HF_DATASETS_OFFLINE = True  # in case it was imported before the variable was set
    return datasets


def is_dataset_dir(path: Path) -> bool:
    """A ``save_to_disk`` directory (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def is_hf_input(path: Path | str) -> bool:
    """Whether prepare-data reads ``path`` as a Hugging Face dataset (no import, no file read)."""
    if str(path).startswith(HF_PREFIX):
        return True
    p = Path(path).expanduser()
    return (p.is_file() and p.suffix.lower() in (PARQUET, ARROW)) or (p.is_dir() and is_dataset_dir(p))


def _stat(path: Path, rows: int, row_groups: tuple[int, ...] = ()) -> HFFile:
    st = path.stat()
    return HFFile(path, st.st_size, st.st_mtime_ns, rows, row_groups)


def _parquet_file(path: Path) -> HFFile:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise InvalidInputError(f"{path} is not a readable parquet file: {exc}") from exc
    groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return _stat(path, meta.num_rows, groups)


def _arrow_file(path: Path, datasets: ModuleType) -> HFFile:
    try:
        rows = datasets.Dataset.from_file(str(path)).num_rows  # memory-mapped: nothing is read
    except Exception as exc:  # pyarrow.ArrowInvalid and friends
        raise InvalidInputError(f"{path} is not a readable Arrow file written by `datasets`: {exc}") from exc
    return _stat(path, rows)


def _data_files(directory: Path) -> list[Path]:
    found = sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.suffix.lower() in (PARQUET, ARROW)
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    if not found:
        raise InvalidInputError(
            f"{directory} is neither a save_to_disk directory nor a directory of .parquet or .arrow files"
        )
    if len({p.suffix.lower() for p in found}) > 1:
        raise InvalidInputError(f"{directory} mixes .parquet and .arrow files: give each kind as its own input")
    return found


def _from_disk(path: Path, split: str | None, datasets: ModuleType) -> HFDataset:
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged state.json or a missing shard
        raise InvalidInputError(f"{path} is not a readable save_to_disk dataset: {exc}") from exc
    name = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        chosen = split or ("train" if "train" in loaded else splits[0] if len(splits) == 1 else None)
        if chosen not in loaded:
            raise InvalidInputError(
                f"{path} is a DatasetDict with splits {', '.join(splits)}: choose one with --hf-split NAME"
            )
        loaded, name = loaded[chosen], f"{path} [split {chosen}]"
        split = chosen
    elif split is not None:
        raise _single_split(path)
    files = tuple(_arrow_file(Path(c["filename"]), datasets) for c in loaded.cache_files)
    if sum(f.rows for f in files) != loaded.num_rows:
        raise InvalidInputError(
            f"{path}: its Arrow files do not hold its {loaded.num_rows} rows; save it again with Dataset.save_to_disk"
        )
    return HFDataset(name, path, "save_to_disk", split, files)


def _single_split(path: Path) -> InvalidInputError:
    return InvalidInputError(
        f"--hf-split applies to a DatasetDict directory (one with dataset_dict.json); "
        f"{path} holds a single split: drop --hf-split"
    )


def resolve(spec: Path | str, split: str | None = None) -> HFDataset:
    """The local dataset ``spec`` names (``hf:PATH`` or a path :func:`is_hf_input` accepts)."""
    text = str(spec)
    raw = text.removeprefix(HF_PREFIX)
    remote = _URL.match(raw) is not None
    if remote or not (path := Path(raw).expanduser()).exists():
        hub = remote or _HUB_ID.match(raw) is not None
        why = "is not a local path" if hub else "does not exist"
        raise InvalidInputError(
            f"input {text} {why}: prepare-data reads only local datasets and never downloads from the Hugging Face "
            "Hub. Download it first, e.g. `python -c \"import datasets; datasets.load_dataset('ORG/NAME', "
            "split='train').save_to_disk('DIR')\"`, then give hf:DIR"
        )
    datasets = require_datasets(text)
    path = path.resolve()
    if path.is_dir() and is_dataset_dir(path):
        return _from_disk(path, split, datasets)
    if split is not None:
        raise _single_split(path)
    paths = _data_files(path) if path.is_dir() else [path]
    kind = paths[0].suffix.lower()
    if kind not in (PARQUET, ARROW):
        raise InvalidInputError(f"{path} is not a .parquet or .arrow file (nor a save_to_disk directory)")
    files = tuple(_parquet_file(p) if kind == PARQUET else _arrow_file(p, datasets) for p in paths)
    return HFDataset(str(path), path, "parquet" if kind == PARQUET else "arrow", None, files)


def records_per_segment(ds: HFDataset, segment_bytes: int) -> int:
    """Records in about ``segment_bytes`` of the on-disk data: the dataset's train/val unit."""
    return max(1, segment_bytes * ds.rows // max(ds.size, 1))


def unit_ranges(ds: HFDataset, target_records: int) -> list[tuple[int, int]]:
    """Contiguous record ranges covering the dataset once: ~``target_records`` each, whole row groups for parquet."""
    target = max(1, target_records)
    if ds.layout != "parquet":
        return [(a, min(a + target, ds.rows)) for a in range(0, ds.rows, target)]
    ranges: list[tuple[int, int]] = []
    pos = 0
    for f in ds.files:
        start = pos
        for n in f.row_groups:
            pos += n
            if pos - start >= target:
                ranges.append((start, pos))
                start = pos
        if pos > start:
            ranges.append((start, pos))
    return ranges


def bytes_between(ds: HFDataset, a: int, b: int) -> int:
    """On-disk bytes credited to records ``a .. b - 1`` for progress (the units' shares sum to ``size``)."""
    rows = max(ds.rows, 1)
    return ds.size * b // rows - ds.size * a // rows


def sha256(ds: HFDataset) -> str:
    """SHA-256 of the backing files' bytes, concatenated in order."""
    h = hashlib.sha256()
    for f in ds.files:
        with open(f.path, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


_OPEN: dict[str, Any] = {}


def _arrow_view(ds: HFDataset) -> Any:
    """The dataset memory-mapped, Arrow-formatted (slicing it copies nothing), cached per process."""
    if ds.key not in _OPEN:
        datasets = require_datasets(ds.name)
        if ds.layout == "save_to_disk":
            loaded = datasets.load_from_disk(str(ds.root))
            opened = loaded[ds.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:
            parts = [datasets.Dataset.from_file(str(f.path)) for f in ds.files]
            opened = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        while len(_OPEN) >= _MAX_OPEN:
            _OPEN.pop(next(iter(_OPEN)))
        _OPEN[ds.key] = opened.with_format("arrow")
    return _OPEN[ds.key]


def _spans(start: int, stop: int, boundary: int) -> Iterator[tuple[int, int]]:
    """``start .. stop`` cut at the multiples of ``boundary``."""
    a = start
    while a < stop:
        b = min(stop, (a // boundary + 1) * boundary)
        yield a, b
        a = b


def _parquet_batches(ds: HFDataset, field: str, first: int, stop: int, batch: int) -> Iterator[Records]:
    import pyarrow.parquet as pq

    base = 0
    for f in ds.files:
        lo, hi = max(first, base), min(stop, base + f.rows)
        if lo < hi:
            pf = pq.ParquetFile(f.path)
            columns = tuple(pf.schema_arrow.names)
            if field not in columns:
                yield Records(lo, hi, None, columns)
            else:
                groups, pos, g0 = [], base, None
                for i, n in enumerate(f.row_groups):
                    if pos < hi and pos + n > lo:
                        groups.append(i)
                        g0 = pos if g0 is None else g0
                    pos += n
                at = g0 if g0 is not None else lo
                for rb in pf.iter_batches(batch_size=batch, row_groups=groups, columns=[field]):
                    a, b = max(at, lo), min(at + rb.num_rows, hi)
                    if a < b:
                        yield Records(a, b, rb.column(0).slice(a - at, b - a).to_pylist(), columns)
                    at += rb.num_rows
        base += f.rows


def read_column(ds: HFDataset, field: str, first: int, count: int, boundary: int) -> Iterator[Records]:
    """Records ``first .. first + count - 1``, in order, in pieces that never cross a multiple of ``boundary``."""
    stop = first + count
    if ds.layout == "parquet":
        pieces = _parquet_batches(ds, field, first, stop, max(1, min(boundary, 1 << 16)))
    else:
        view = _arrow_view(ds)
        columns = tuple(view.column_names)
        if field not in columns:
            pieces = iter([Records(first, stop, None, columns)])
        else:
            pieces = (
                Records(a, b, view[a:b].column(field).to_pylist(), columns) for a, b in _spans(first, stop, boundary)
            )
    for piece in pieces:
        for a, b in _spans(piece.start, piece.stop, boundary):
            values = None if piece.values is None else piece.values[a - piece.start : b - piece.start]
            yield Records(a, b, values, piece.columns)
