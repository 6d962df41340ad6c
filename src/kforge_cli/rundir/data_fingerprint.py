"""What data a run trains on, as a short fingerprint a checkpoint records and a resume compares.

A prepared directory's fingerprint is a hash of its ``metadata.json`` (which holds each
source's SHA-256, the options and every shard's token count) and of each shard's file size;
no shard is read, so it costs the same for 10 MB as for 10 TB. The built-in corpus has a fixed
one per version of its generator (``engine.data.builtin_corpus``). A mixture has one per
dataset. Re-preparing other inputs into the same ``--out`` changes the fingerprint; running
``prepare-data`` again on unchanged inputs is a no-op and keeps it.

``data_fingerprints`` gives the fingerprints of the run's data from its settings, and
``checkpoint_data_fingerprints`` reads the ones a checkpoint recorded (``train_state.json``),
both without torch, so a command refuses a resume on changed data before it starts anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.files import read_text_capped
from kforge_cli.rundir.names import TRAIN_STATE_FILE

if TYPE_CHECKING:
    from kforge_cli.settings.job import JobSettings

METADATA = "metadata.json"  # a prepared directory's (engine.data.shards.METADATA)
MAX_METADATA_BYTES = 64 << 20
MAX_STATE_BYTES = 64 << 20
BUILTIN_PREFIX = "builtin:"


def builtin_fingerprint(version: int) -> str:
    """The built-in corpus of generator version `version`."""
    return f"{BUILTIN_PREFIX}v{version}"


def prepared_fingerprint(root: Path | str) -> str:
    """``sha256:<16 hex>`` of DIR/metadata.json's bytes and the name and size of each shard it lists.

    A directory whose metadata.json is missing or unreadable gets ``unreadable:<reason>`` (the
    loader refuses such a directory with its own message).
    """
    root = Path(root).expanduser().resolve()
    try:
        text = read_text_capped(root / METADATA, MAX_METADATA_BYTES, "metadata")
        meta: object = json.loads(text)
    except Exception as exc:  # OSError, ValueError, kforge's refusal of a FIFO or an oversized file
        return f"unreadable:{type(exc).__name__}"
    digest = hashlib.sha256(text.encode())
    splits = meta.get("splits") if isinstance(meta, dict) else None
    splits = splits if isinstance(splits, dict) else {}
    for split in sorted(splits):
        info = splits[split]
        shards = info.get("shards") if isinstance(info, dict) else None
        for entry in shards if isinstance(shards, list) else []:
            name = entry.get("file") if isinstance(entry, dict) else None
            if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
                continue
            try:
                size = (root / name).stat().st_size
            except OSError:
                size = -1
            digest.update(f"\0{split}/{name}:{size}".encode())
    return "sha256:" + digest.hexdigest()[:16]


def data_fingerprints(settings: JobSettings) -> list[str] | None:
    """One fingerprint per training dataset of `settings` (None for the built-in corpus: the engine
    knows its version)."""
    data = settings.data
    if data.datasets:
        return [prepared_fingerprint(d.path) for d in data.datasets]
    if data.path:
        return [prepared_fingerprint(data.path)]
    return None


def checkpoint_data_fingerprints(step_dir: Path) -> list[str] | None:
    """The data fingerprints a checkpoint recorded (None: none recorded, e.g. an older checkpoint)."""
    try:
        state: object = json.loads(read_text_capped(step_dir / TRAIN_STATE_FILE, MAX_STATE_BYTES, "train state"))
    except Exception:  # unreadable here: the restore names the problem
        return None
    loader = state.get("data") if isinstance(state, dict) else None  # the data loader's state
    prints = loader.get("dataset_fingerprints") if isinstance(loader, dict) else None
    if isinstance(prints, list) and all(isinstance(p, str) for p in prints):
        return list(prints)
    return None


def describe(prints: list[str] | None, names: list[str] | None = None) -> str:
    """`sha256:ab12...` or `mine=sha256:..., code=sha256:...` for a message."""
    if not prints:
        return "(none recorded)"
    if names and len(names) == len(prints) and len(prints) > 1:
        return ", ".join(f"{n}={p}" for n, p in zip(names, prints, strict=True))
    return ", ".join(prints)


def changed_data_message(theirs: object, ours: list[str], names: list[str] | None = None) -> str:
    """The refusal of a resume on data other than the checkpoint's (both fingerprints named)."""
    old = describe(theirs if isinstance(theirs, list) else [str(theirs)], names)
    return (
        f"the checkpoint trained on data with fingerprint {old}; the data now has fingerprint "
        f"{describe(ours, names)}: it was re-prepared or changed, so the run cannot continue with exactly the "
        "next batch. Restore the original data, or continue on the new data anyway with "
        "--data.allow_changed_data=true (or by typing its --data.path), or start from the weights only "
        "(--checkpoint.init_from)"
    )
