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

from kforge_cli.common.files import copy_file_atomic
from kforge_cli.engine.data.shards import load_prepared
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.names import TOKENIZER_FILE
from kforge_cli.rundir.saved_config import read_saved_config
from kforge_cli.settings.data import DataSettings

log = logging.getLogger("kforge")


def _prepared_dir(data: DataSettings | dict[str, object]) -> str | None:
    """The first prepared directory named by a data section (datasets share one tokenizer)."""
    if isinstance(data, DataSettings):
        return data.datasets[0].path if data.datasets else data.path
    datasets = data.get("datasets")
    first = datasets[0] if isinstance(datasets, list) and datasets else None
    if isinstance(first, dict) and isinstance(first.get("path"), str):
        return first["path"]
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
    target = RunDir(run_dir).tokenizer
    if target.is_symlink():
        raise InvalidInputError(f"{target} is a symlink; kforge does not write through links in a run directory")
    copy_file_atomic(source.root / TOKENIZER_FILE, target)  # unique temp, never through a planted link
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
    run = RunDir(run_dir)
    if run.tokenizer.is_file() and not run.tokenizer.is_symlink():
        return HFTokenizer(run.tokenizer)
    if not run.has_config():
        return _assume_byte(f"{run_dir} has neither {TOKENIZER_FILE} nor {run.config.name}")
    try:
        data = read_saved_config(run.path).get("data", {})
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
    return HFTokenizer(meta.root / TOKENIZER_FILE)
