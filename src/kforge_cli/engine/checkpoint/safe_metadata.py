"""Reading DCP checkpoints without running code hidden in them.

torch's ``FileSystemReader.read_metadata`` opens ``.metadata`` with plain
``pickle.load`` and its default load planner reads non-tensor values with
``torch.load(weights_only=False)``: a checkpoint written by someone else could run
arbitrary code the moment it is opened. Here ``.metadata`` goes through an unpickler
that resolves only DCP's own metadata classes and the few torch/pathlib objects they
hold, and byte items go through ``torch.load(weights_only=True)``. Anything else is an
:class:`UnsafeCheckpointError` naming the file; the payload is never called. What unpickles
is then checked as data (:mod:`.metadata_checks`): shapes backed by stored bytes, storage
paths plain names inside the directory, offsets and lengths within the files.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import IO, Any, NoReturn

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from kforge_cli.engine.checkpoint.metadata_checks import check_storage_files, check_structure

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [(_DCP_METADATA, name) for name in _METADATA_CLASSES]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    ]
)


def weights_only_reason(exc: BaseException) -> str:
    """The line of torch's weights_only refusal that names the offending global (else its first line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(exc).__name__)


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's ``Metadata`` is made of; refuses everything else by name."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_dtype(module, name):
            return getattr(importlib.import_module(module), name)
        raise UnsafeCheckpointError(
            f"refusing to open {self.path}: it references {module}.{name}, which is not part of DCP checkpoint "
            "metadata, so the file may carry code that would run when loaded. Use only checkpoints you trust; "
            "a kforge checkpoint never contains this."
        )

    def persistent_load(self, pid: object) -> NoReturn:
        raise UnsafeCheckpointError(f"refusing to open {self.path}: unexpected persistent id in DCP metadata")


def load_metadata_file(path: Path) -> Metadata:
    """Unpickle one DCP metadata file with the restricted unpickler."""
    try:
        with path.open("rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete (its save never finished)") from None
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or garbage bytes
        raise CheckpointError(f"{path} is not readable DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"refusing {path}: it holds a {type(md).__name__}, not DCP Metadata")
    return check_structure(md, path)


def read_dcp_metadata(checkpoint_dir: str | Path) -> Metadata:
    """The DCP ``Metadata`` of a checkpoint directory (every tensor's global shape, dtype and chunks)."""
    return load_metadata_file(Path(checkpoint_dir) / METADATA_FILE)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by the restricted unpickler and checked as data.

    The metadata is read and checked (structure, then every shard file it names) when the
    reader is made, outside DCP: DCP swallows a failing ``read_metadata`` into an
    ``AssertionError``, and nothing may be read from a shard before these checks pass.
    """

    def __init__(self, path: str | Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._checked = load_metadata_file(Path(path) / METADATA_FILE)
        check_storage_files(self._checked, Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = self._checked if rank is None else load_metadata_file(Path(self.path) / f"__{rank}{METADATA_FILE}")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        assert md.storage_meta is not None
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor items with ``weights_only=True``."""

    def __init__(self, source: Path, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.source = source

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"refusing the item {fqn!r} of {self.source}: it is not plain data ({weights_only_reason(exc)}); "
                "the checkpoint may carry code. Use only checkpoints you trust."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
