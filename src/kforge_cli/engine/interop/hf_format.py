"""Hugging Face checkpoint files, family-independent: the file names, the one bounded
``config.json`` reader every family's importer goes through, and the safetensors files of a
directory (index entries checked to stay inside it). A family's name and config mapping is its
own (``ModelFamily.hf``). Imports no torch (the warm-start decision uses :func:`is_hf_dir` on rank 0).
"""

from __future__ import annotations

import json
from pathlib import Path

from kforge_cli.common.files import read_text_capped
from kforge_cli.common.hf_numbers import check_hf_numbers
from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.errors import KforgeError
from kforge_cli.rundir.checkpoints import HF_CONFIG_FILE

CONFIG_FILE = HF_CONFIG_FILE
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

MAX_JSON_BYTES = 64 << 20  # config.json, the index: KBs to a few MB in any real model


def _read_text(path: Path) -> str:
    return read_text_capped(path, MAX_JSON_BYTES, "file")  # a FIFO or device is refused, never read


def read_hf_config(hf_dir: Path) -> dict[str, object]:
    """``HF_DIR/config.json``: read capped, a JSON object, its shape numbers bounded (:func:`check_hf_numbers`)."""
    path = hf_dir / CONFIG_FILE
    try:
        data = json.loads(_read_text(path))
    except (OSError, ValueError, RecursionError, KforgeError) as exc:
        raise CheckpointError(f"{path} is not a readable Hugging Face config ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    check_hf_numbers(data, path, error=CheckpointError)
    return data


def _inside(target: Path, hf_dir: Path) -> bool:
    """`target` (resolved) lies in the model directory, or in the blob store of the Hugging Face hub cache
    snapshot it is (``models--org--name/snapshots/REV`` links every file to ``../../blobs/``)."""
    root = hf_dir.resolve()
    if target.is_relative_to(root):
        return True
    return root.parent.name == "snapshots" and target.is_relative_to(root.parent.parent / "blobs")


def checked_weight_file(hf_dir: Path, name: object, source: Path) -> Path:
    """The weight file `name` (as `source` names it) of the model in `hf_dir`, if it is one.

    Like a DCP checkpoint's storage paths: a plain file name (no directory part, no ``..``),
    a regular file (a FIFO would hang the read, a device never end), and, when a symbolic
    link, one that stays inside the model directory (or its hub cache blob store).
    """
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise CheckpointError(f"{source} names {name!r} as a weight file: only a plain file name in {hf_dir} is read")
    path = hf_dir / name
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise CheckpointError(f"{source} names {name}, which does not exist in {hf_dir}") from None
    if not target.is_file():
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device or directory): refusing to read it")
    if not _inside(target, hf_dir):
        raise CheckpointError(f"{path} is a link to {target}, outside the model directory: refusing to read it")
    return path


def hf_weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face model (those its index names, else every ``*.safetensors``)."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(_read_text(index))["weight_map"]
            names = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, KforgeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
        return [checked_weight_file(hf_dir, name, index) for name in sorted(names, key=str)]
    files = [checked_weight_file(hf_dir, p.name, hf_dir) for p in sorted(hf_dir.glob("*.safetensors"))]
    if not files:
        bins = sorted(p.name for p in hf_dir.glob("*.bin"))
        extra = (
            f" (found {', '.join(bins)}: pickle files are not loaded; re-save with safe_serialization)" if bins else ""
        )
        raise CheckpointError(f"{hf_dir} has no *.safetensors weights{extra}")
    return files
