"""DCP ``.metadata`` is data from disk: check its shape, paths, offsets and sizes before any read.

torch trusts the metadata it unpickles: each storage entry's ``relative_path`` is joined to
the checkpoint directory (an absolute path or ``../other_run/__0_0.distcp`` reads another
file), its ``offset``/``length`` are seeked and read as given (``/dev/zero`` yields gigabytes),
and a tensor's declared ``size`` is what callers allocate (``size=[2**40]`` from a 100 KB
file). Two checks close that:

* :func:`check_structure` (no file access): the object tree has the types DCP writes, every
  tensor's chunks lie inside it and cover it, each chunk has a storage entry whose length can
  hold the chunk's bytes (so declared shapes are bounded by stored bytes), and every storage
  path is a plain file name. Run on every ``.metadata`` kforge opens.
* :func:`check_storage_files` (stat only): every named file is a regular file inside the
  directory and long enough for ``offset + length``. Run before any shard is read; ``--verify``
  reports the same facts as problems instead of stopping.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path, PurePath

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError

# torch.save's zip container around a chunk's raw bytes is a few hundred bytes; a chunk can never
# need more bytes than its storage entry holds (raw safetensors-style entries hold exactly them).
_MAX_DIMS = 64


class MalformedMetadataError(CheckpointError):
    """A ``.metadata`` whose content is not what DCP writes (crafted or damaged): exit 2, names the entry."""


def _ints(value: object, what: str, path: Path) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or len(value) > _MAX_DIMS:
        raise MalformedMetadataError(f"{path}: {what} is {value!r}, not a list of at most {_MAX_DIMS} integers")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise MalformedMetadataError(f"{path}: {what} is {list(value)!r}; every entry must be an integer >= 0")
        out.append(int(v))
    return tuple(out)


def plain_name(name: object) -> str | None:
    """`name` as a file name directly inside a directory, or None when it is anything else."""
    if isinstance(name, PurePath):
        name = str(name)
    if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name:
        return None
    if "/" in name or "\\" in name:
        return None
    return name


def _storage(md: Metadata, path: Path) -> dict[object, _StorageInfo]:
    storage = md.storage_data
    if storage is None:
        return {}
    if not isinstance(storage, dict):
        raise MalformedMetadataError(f"{path}: storage_data is a {type(storage).__name__}, not a mapping")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise MalformedMetadataError(f"{path}: storage_data holds {type(info).__name__}, not DCP storage entries")
        if plain_name(info.relative_path) is None:
            raise MalformedMetadataError(
                f"{path}: the storage entry of {index.fqn!r} names the file {info.relative_path!r}; a checkpoint may "
                "only name plain files inside its own directory (refusing to read elsewhere)"
            )
        for field in ("offset", "length"):
            v = getattr(info, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MalformedMetadataError(f"{path}: the storage entry of {index.fqn!r} has {field}={v!r}")
    return storage


def _check_tensor(key: str, item: TensorStorageMetadata, storage: dict[object, _StorageInfo], path: Path) -> None:
    props = item.properties
    if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
        raise MalformedMetadataError(f"{path}: tensor {key!r} has properties {props!r}, not a dtype")
    size = _ints(item.size, f"the size of {key!r}", path)
    if not isinstance(item.chunks, list):
        raise MalformedMetadataError(f"{path}: the chunks of {key!r} are a {type(item.chunks).__name__}, not a list")
    itemsize = props.dtype.itemsize
    covered = 0
    for chunk in item.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise MalformedMetadataError(f"{path}: a chunk of {key!r} is a {type(chunk).__name__}")
        offsets = _ints(chunk.offsets, f"a chunk offset of {key!r}", path)
        sizes = _ints(chunk.sizes, f"a chunk size of {key!r}", path)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise MalformedMetadataError(f"{path}: a chunk of {key!r} has {len(sizes)} dims, the tensor {len(size)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise MalformedMetadataError(f"{path}: a chunk of {key!r} at {offsets} size {sizes} lies outside {size}")
        info = storage.get(MetadataIndex(key, offsets))
        if info is None:
            raise MalformedMetadataError(f"{path}: the chunk of {key!r} at {offsets} has no storage entry")
        need = math.prod(sizes) * itemsize
        if not info.transform_descriptors and need > info.length:
            raise MalformedMetadataError(
                f"{path}: tensor {key!r} declares {list(size)} ({props.dtype}), but its chunk at {list(offsets)} "
                f"needs {need} bytes and its storage entry holds {info.length}: refusing a shape the stored bytes "
                "cannot back"
            )
        covered += math.prod(sizes)
    if covered != math.prod(size):
        raise MalformedMetadataError(
            f"{path}: the {len(item.chunks)} chunk(s) of {key!r} hold {covered} of its {math.prod(size)} elements"
        )


def check_structure(md: object, path: Path) -> Metadata:
    """`md` if it is well-formed DCP metadata whose shapes its storage can back (no file access)."""
    if not isinstance(md, Metadata):
        raise MalformedMetadataError(f"{path} holds a {type(md).__name__}, not DCP Metadata")
    items = md.state_dict_metadata
    if not isinstance(items, dict):
        raise MalformedMetadataError(f"{path}: state_dict_metadata is a {type(items).__name__}, not a mapping")
    storage = _storage(md, path)
    for key, item in items.items():
        if not isinstance(key, str):
            raise MalformedMetadataError(f"{path}: a state dict key is {key!r}, not a string")
        if isinstance(item, TensorStorageMetadata):
            _check_tensor(key, item, storage, path)
        elif not isinstance(item, BytesStorageMetadata):
            raise MalformedMetadataError(f"{path}: the entry {key!r} is a {type(item).__name__}, not DCP metadata")
    return md


def storage_file_problems(md: Metadata, directory: Path) -> list[str]:
    """What is wrong with the shard files `md` names in `directory` (missing, outside it, too short)."""
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    problems = []
    base = directory.resolve()
    for name, end in sorted(needed.items()):
        f = directory / name
        try:
            st = os.stat(f)  # a link is fine only when it stays inside the directory (checked next)
        except FileNotFoundError:
            problems.append(f"shard file {f} is missing")
            continue
        except OSError as exc:
            problems.append(f"shard file {f} cannot be read ({exc.strerror})")
            continue
        if f.is_symlink() and not f.resolve().is_relative_to(base):
            problems.append(f"shard file {f} is a link to {f.resolve()}, outside the checkpoint (refused)")
        elif not f.is_file():
            problems.append(f"shard file {f} is not a regular file")
        elif st.st_size < end:
            problems.append(f"shard file {f} is truncated: {st.st_size} bytes, its metadata needs {end}")
    return problems


def check_storage_files(md: Metadata, directory: Path) -> None:
    """Raise when a shard file `md` names is missing, outside `directory` or shorter than its entries."""
    problems = storage_file_problems(md, directory)
    if problems:
        shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        raise CheckpointError(f"{directory} is damaged: {shown}")
