"""The tokenizer a run was trained with, recorded in and recovered from its run directory.

Generation and evaluation must encode text exactly as training did. Training copies a
prepared directory's ``tokenizer.json`` into ``RUN_DIR/tokenizer.json`` (the data
directory may be moved or deleted later); a run without that file (byte tokenizer, or
one from before this was recorded) falls back to its ``config.toml``: the prepared
directory it names, else the byte tokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kforge_cli.engine.data.shards import load_prepared
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kforge_cli.errors import InvalidInputError
from kforge_cli.files import copy_file_atomic, read_toml_file
from kforge_cli.settings.data import DataSettings

RUN_TOKENIZER = "tokenizer.json"
log = logging.getLogger("kforge")


def _prepared_dir(data: DataSettings | dict[str, Any]) -> str | None:
    """The first prepared directory named by a data section (datasets share one tokenizer)."""
    if isinstance(data, DataSettings):
        return data.datasets[0].path if data.datasets else data.path
    datasets = data.get("datasets") or []
    if datasets and isinstance(datasets[0], dict) and isinstance(datasets[0].get("path"), str):
        return datasets[0]["path"]
    path = data.get("path")
    return path if isinstance(path, str) else None


def record_run_tokenizer(data: DataSettings, run_dir: Path) -> Path | None:
    """Copy the training data's ``tokenizer.json`` into RUN_DIR (None: byte tokenizer or built-in corpus)."""
    prepared = _prepared_dir(data)
    if prepared is None:
        return None
    source = load_prepared(prepared)
    if source.tokenizer.get("kind") != "hf":
        return None
    target = run_dir / RUN_TOKENIZER
    if target.is_symlink():
        raise InvalidInputError(f"{target} is a symlink; kforge does not write through links in a run directory")
    copy_file_atomic(source.root / RUN_TOKENIZER, target)  # unique temp, never through a planted link
    return target


def _assume_byte(why: str) -> ByteTokenizer:
    log.warning(
        "%s, so nothing records its tokenizer: assuming the byte tokenizer. If it was trained with another, "
        "pass --tokenizer PATH/tokenizer.json",
        why,
    )
    return ByteTokenizer()


def run_tokenizer(run_dir: Path | None, override: str | None = None, what: str = "") -> ByteTokenizer | HFTokenizer:
    """The tokenizer of the run in `run_dir` (`override`: 'byte' or a tokenizer.json path wins).

    When nothing records which tokenizer the run used (no run directory, no tokenizer.json,
    no config.toml) the byte tokenizer is assumed, never silently: a warning names `what`.
    """
    if override:
        return load_tokenizer(override)
    if run_dir is None:
        return _assume_byte(f"{what or 'this checkpoint'} is not inside a run directory")
    recorded = run_dir / RUN_TOKENIZER
    if recorded.is_file() and not recorded.is_symlink():
        return HFTokenizer(recorded)
    config = run_dir / "config.toml"
    if not config.is_file():
        return _assume_byte(f"{run_dir} has neither {RUN_TOKENIZER} nor config.toml")
    try:
        data = read_toml_file(config).get("data", {})
    except InvalidInputError as exc:
        raise InvalidInputError(f"{exc}; pass --tokenizer byte or PATH") from None
    prepared = _prepared_dir(data if isinstance(data, dict) else {})
    if prepared is None:
        return ByteTokenizer()
    try:
        meta = load_prepared(prepared)
    except InvalidInputError as exc:
        raise InvalidInputError(
            f"the run's tokenizer lives in its data directory, which is unusable ({exc}); pass --tokenizer PATH"
        ) from exc
    if meta.tokenizer.get("kind") != "hf":
        return ByteTokenizer()
    return HFTokenizer(meta.root / RUN_TOKENIZER)
