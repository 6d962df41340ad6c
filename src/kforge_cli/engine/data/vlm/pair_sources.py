"""Image-text and clip-text samples from disk: a JSONL manifest or a directory of pairs.

``vlm.data_path`` may be

- a JSONL manifest: one object per line, ``{"image": PATH, "caption": TEXT}`` or
  ``{"video": PATH, "caption": TEXT}`` (a clip: a directory of frames or a ``.npy``);
  relative paths are relative to the manifest's directory;
- a directory holding ``train.jsonl`` (and optionally ``val.jsonl``, the eval set);
- any other directory: every image file, ``.npy`` clip or sub-directory of frames that
  has a caption file of the same name with ``.txt`` (``cat.png`` + ``cat.txt``).

Missing files are found when the data is built, before any step: a clear error naming
the file, or (``vlm.skip_bad_samples``) the sample is dropped and counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from kforge_cli.common.files import read_text_capped
from kforge_cli.engine.data.vlm.media import IMAGE_SUFFIXES, BadSampleError, load_clip, load_image
from kforge_cli.errors import InvalidInputError

log = logging.getLogger("kforge")


@dataclass(frozen=True)
class Record:
    kind: Literal["image", "video"]
    path: Path
    caption: str
    where: str  # where the record was defined (manifest:line, or the caption file)


MAX_MANIFEST_BYTES = 2 << 30  # a JSONL manifest of millions of records; the files it names hold the data


def read_manifest(path: Path) -> list[Record]:
    """Records of a JSONL manifest (errors name the file and line)."""
    out: list[Record] = []
    try:
        lines = read_text_capped(path, MAX_MANIFEST_BYTES, "manifest").splitlines()  # a FIFO is refused
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read manifest {path}: {exc}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InvalidInputError(f"{where}: not valid JSON ({exc})") from None
        kinds = [k for k in ("image", "video") if isinstance(obj, dict) and k in obj]
        if len(kinds) != 1 or not isinstance(obj.get("caption"), str) or not isinstance(obj[kinds[0]], str):
            raise InvalidInputError(f'{where}: expected {{"image": PATH, "caption": TEXT}} or {{"video": PATH, ...}}')
        kind: Literal["image", "video"] = "image" if kinds[0] == "image" else "video"
        out.append(Record(kind, (path.parent / obj[kind]).expanduser(), obj["caption"], where))
    if not out:
        raise InvalidInputError(f"manifest {path} holds no records")
    return out


def scan_directory(root: Path) -> list[Record]:
    """Every image / clip in ``root`` with a same-named ``.txt`` caption (sorted by name)."""
    out: list[Record] = []
    for item in sorted(root.iterdir()):
        if item.suffix.lower() == ".txt" or item.name.startswith("."):
            continue
        is_image = item.is_file() and item.suffix.lower() in IMAGE_SUFFIXES
        is_clip = item.is_dir() or (item.is_file() and item.suffix.lower() == ".npy")
        if not (is_image or is_clip):
            continue
        caption_file = item.with_suffix(".txt") if item.is_file() else item.parent / f"{item.name}.txt"
        if not caption_file.is_file():
            raise InvalidInputError(f"{item} has no caption file {caption_file.name} next to it")
        caption = caption_file.read_text(encoding="utf-8").strip()
        out.append(Record("image" if is_image else "video", item, caption, str(caption_file)))
    if not out:
        raise InvalidInputError(f"{root} holds no image/clip with a .txt caption, and no train.jsonl manifest")
    return out


def resolve_records(data_path: str) -> tuple[str, list[Record], list[Record] | None]:
    """(dataset name, train records, val records or None) for ``vlm.data_path``."""
    path = Path(data_path).expanduser()
    if path.is_file():
        return path.stem, read_manifest(path), None
    if not path.is_dir():
        raise InvalidInputError(f"vlm.data_path {path} does not exist; give a JSONL manifest or a directory")
    if (path / "train.jsonl").is_file():
        val = read_manifest(path / "val.jsonl") if (path / "val.jsonl").is_file() else None
        return path.name, read_manifest(path / "train.jsonl"), val
    return path.name, scan_directory(path), None


def drop_missing(records: list[Record], skip: bool) -> list[Record]:
    """Records whose media exist; a missing one is an error naming it, or dropped and counted when ``skip``."""
    kept, dropped = [], []
    for r in records:
        if r.path.exists():
            kept.append(r)
        elif skip:
            dropped.append(r)
        else:
            raise BadSampleError(
                f"{r.kind} {r.path} (from {r.where}) does not exist; fix the path, or set "
                "--vlm.skip_bad_samples=true to skip such samples"
            )
    if dropped:
        log.warning(
            "skipped %d of %d samples whose files are missing, e.g. %s", len(dropped), len(records), dropped[0].path
        )
    if not kept:
        raise InvalidInputError("no usable samples: every image/clip file is missing")
    return kept


class ManifestCaptions:
    """Records read lazily; :meth:`load` gives ``(frames [n, C, H, W] float32 in [0, 1], caption)``."""

    def __init__(self, records: list[Record], image_size: int, channels: int, max_frames: int, stride: int) -> None:
        self.records = records
        self.image_size, self.channels, self.max_frames, self.stride = image_size, channels, max_frames, stride

    def __len__(self) -> int:
        return len(self.records)

    def where(self, index: int) -> str:
        r = self.records[index]
        return f"{r.path} (from {r.where})"

    def caption(self, index: int) -> str:
        return self.records[index].caption

    def load(self, index: int) -> tuple[np.ndarray, str]:
        r = self.records[index]
        if r.kind == "image":
            frames = load_image(r.path, self.image_size, self.channels)[None]
        else:
            frames = load_clip(r.path, self.image_size, self.channels, self.max_frames, self.stride)
        return frames, r.caption
