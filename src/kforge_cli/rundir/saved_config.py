"""A run's settings on disk: ``config.toml``, written once, and the changes accepted since.

``RUN_DIR/config.toml`` holds the fully resolved settings of the command that started the
run and is never rewritten. A later command that continues the run with other settings
(``kforge resume RUN --train.max_steps=N``, ``kforge train --run-dir RUN --key=value``, either
with ``--sbatch``) is checked first (:func:`continuation_issues`) and changes nothing when
refused; once accepted, its changes are appended to ``RUN_DIR/config_changes.jsonl``, one
JSON line per command::

    {"time": "2026-01-02T03:04:05+00:00", "command": "kforge resume runs/x --train.max_steps=4",
     "changes": {"train.max_steps": {"from": 2, "to": 4}}}

The run's settings are ``config.toml`` with each line's changes applied in order
(:func:`read_saved_config`); every reader of a run's settings goes through it. Imports no torch.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kforge_cli.common.files import MAX_TOML_BYTES, atomic_write, open_append, read_text_capped, read_toml_file
from kforge_cli.errors import CheckpointError, ConfigIssue, InvalidInputError
from kforge_cli.rundir.checkpoints import newest_complete
from kforge_cli.rundir.fingerprint import shaping_config, shaping_diff
from kforge_cli.rundir.layout import RunDir

if TYPE_CHECKING:  # the settings (pydantic) load where they are used: reading a run's raw config needs none
    from kforge_cli.settings.job import JobSettings

# Keys that belong to one command, not to the run: where the run lives now (it may have been
# moved), whether this command resumes and whether it accepts changed data. They are never
# recorded as changes.
PER_COMMAND_KEYS = frozenset({"train.run_dir", "checkpoint.resume", "data.allow_changed_data"})

Change = tuple[str, object, object]  # (dotted key, the run's value, the new value)

# What the run learns from: the model, the data and its order, the optimizer and schedule, the
# steps and batches, the numerics (as opposed to how it runs: parallelism, checkpoint cadence,
# logging, hooks, threads, loader workers, SLURM). A continuation by `kforge train` with other
# arguments must type a change to any setting, these and the others alike (cli.resume).
_LEARNING_SECTIONS = frozenset({"model", "optimizer", "scheduler", "data", "vision_encoder", "adapter", "vlm", "video"})
_LEARNING_TRAIN_KEYS = frozenset(
    {
        "batch_size",
        "seq_len",
        "max_steps",
        "grad_accum_steps",
        "grad_clip_norm",
        "seed",
        "data_seed",
        "mixed_precision",
        "master_dtype",
        "float8",
        "float8_recipe",
        "z_loss_weight",
    }
)
_DATA_LOADER_KEYS = frozenset({"num_workers", "prefetch_factor", "pin_memory"})


def shapes_learning(key: str) -> bool:
    """True when the setting at dotted `key` changes what the run learns (see the sets above)."""
    section, _, rest = key.partition(".")
    name = rest.split(".", 1)[0]
    if section == "train":
        return name in _LEARNING_TRAIN_KEYS
    if section == "data":
        return name not in _DATA_LOADER_KEYS
    return section in _LEARNING_SECTIONS


def read_saved_config(run_dir: Path, *, missing_ok: bool = False) -> dict[str, object]:
    """The run's settings as a dict: RUN_DIR/config.toml plus every accepted change, in order.

    A missing or unreadable file is a clear error, or ``{}`` with ``missing_ok`` (readers that
    fall back to something else, e.g. a checkpoint's own shaping record).
    """
    run = RunDir(run_dir)
    try:
        if run.config.is_symlink():
            raise CheckpointError(f"{run.config} is a symbolic link; a run's config.toml must be the file itself")
        if not run.config.is_file():
            raise CheckpointError(
                f"{run.config} not found: {run.path} is not a kforge run directory "
                f"(kforge train writes {run.config.name} there)"
            )
        raw = read_toml_file(run.config, "the run's settings")  # capped; a FIFO or device is refused
        return apply_changes(raw, read_changes(run.path))
    except InvalidInputError:
        if missing_ok:
            return {}
        raise


def read_changes(run_dir: Path) -> list[dict[str, object]]:
    """The records of RUN_DIR/config_changes.jsonl, oldest first ([] when there is none).

    A torn last line (a process killed while appending) is a change that was never
    recorded and is skipped; any other unreadable line is an error naming the file and line.
    """
    path = RunDir(run_dir).config_changes
    try:
        lines = read_text_capped(path, 4 * MAX_TOML_BYTES, "config changes file").splitlines()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path} is unreadable ({exc}); move it away to use config.toml alone") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record: object = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue
            raise InvalidInputError(f"{path}:{number} is not a JSON object (a damaged line)") from None
        if not isinstance(record, dict) or not isinstance(record.get("changes"), dict):
            raise InvalidInputError(f"{path}:{number} has no 'changes' object")
        records.append(record)
    return records


def apply_changes(raw: dict[str, object], records: list[dict[str, object]]) -> dict[str, object]:
    """`raw` (a config.toml as a dict) with each record's ``to`` values set, in order."""
    out = copy.deepcopy(raw)
    for record in records:
        changes = record["changes"]
        if not isinstance(changes, dict):  # read_changes refuses such a record
            continue
        for key, change in changes.items():
            if isinstance(change, dict) and "to" in change:
                _set(out, key, change["to"])
    return out


def _set(data: dict[str, object], dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def settings_changes(old: JobSettings, new: JobSettings) -> list[Change]:
    """(key, old, new) for every setting that differs, at the shallowest level that differs, sorted.

    A section switched on or off (``vlm``) is one change of the whole section. Keys of
    :data:`PER_COMMAND_KEYS` are left out.
    """
    out: list[Change] = []
    _diff(old.model_dump(mode="json"), new.model_dump(mode="json"), "", out)
    return sorted((c for c in out if c[0] not in PER_COMMAND_KEYS), key=lambda c: c[0])


def _diff(old: object, new: object, prefix: str, out: list[Change]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            _diff(old.get(key), new.get(key), f"{prefix}{key}.", out)
    elif old != new:
        out.append((prefix.rstrip("."), old, new))


def _data_order(settings: JobSettings) -> dict[str, object]:
    """What a checkpoint's data order was built from (engine.data.loader refuses a resume that changes it)."""
    return {
        "data.path": settings.data.path,
        "data.datasets": [(d.name, d.path) for d in settings.data.datasets],
        "train.seq_len": settings.train.seq_len,
        "data seed": settings.data_seed,
    }


def has_checkpoint(run_dir: Path, settings: JobSettings) -> bool:
    """True when the run has a complete checkpoint that a continuation would resume from."""
    return newest_complete(RunDir(run_dir).checkpoint_root(settings))[0] is not None


def continuation_issues(
    saved: JobSettings,
    new: JobSettings,
    *,
    checkpoint: bool,
    source_of: Callable[[str], str] | None = None,
) -> list[ConfigIssue]:
    """Why `new` cannot continue the run whose settings are `saved` (empty: it can).

    With a complete checkpoint (`checkpoint`), the model's shape and the data order must stay:
    the checkpoint holds those weights and that position in that data. Each issue names the
    run's value, the new one and (with `source_of`) where the new one came from.
    """
    if not checkpoint:
        return []

    def origin(key: str) -> str:
        return f" [from {source_of(key)}]" if source_of is not None else ""

    issues = [
        ConfigIssue(key, f"{old!r} -> {new_value!r} would change the model's shape (the run has {old!r}){origin(key)}")
        for key, old, new_value in shaping_diff(shaping_config(saved), shaping_config(new))
    ]
    before, after = _data_order(saved), _data_order(new)
    for key in before:
        if before[key] == after[key]:
            continue
        if key == "data seed":  # train.data_seed, or train.seed when that is unset
            old, new_value = before[key], after[key]
            key = "train.seed" if new.train.data_seed is None else "train.data_seed"
        elif key == "data.datasets":
            old, new_value = (
                saved.data.model_dump(mode="json")["datasets"],
                new.data.model_dump(mode="json")["datasets"],
            )
        else:
            old, new_value = before[key], after[key]
        issues.append(
            ConfigIssue(
                key,
                f"{old!r} -> {new_value!r} would change the data order its checkpoint continues "
                f"(the run has {old!r}){origin(key)}",
            )
        )
    return issues


def with_run_dir(settings: JobSettings, run_dir: Path) -> JobSettings:
    """A copy of ``settings`` that names ``run_dir`` (what the run's config.toml records)."""
    return settings.model_copy(update={"train": settings.train.model_copy(update={"run_dir": str(run_dir)})})


def saved_settings(run_dir: Path) -> JobSettings:
    """The run's settings (config.toml plus its accepted changes), validated; a clear error when they are not."""
    from kforge_cli.settings.job import JobSettings

    run = RunDir(run_dir)
    try:
        return JobSettings.model_validate(read_saved_config(run.path))
    except InvalidInputError:
        raise
    except Exception as exc:  # pydantic's ValidationError: the file is the user's to fix
        raise InvalidInputError(f"{run.config} does not load as kforge settings ({exc})") from None


def write_or_record(settings: JobSettings, run_dir: Path, *, command: str | None = None) -> list[Change]:
    """Write RUN_DIR/config.toml when the run starts; afterwards record what `settings` change.

    On a new run the file takes the resolved settings (atomically, never through a planted
    link) and nothing else is written. On an existing run config.toml stays as it is: the
    settings that differ from the run's (config.toml plus earlier changes) are appended to
    config_changes.jsonl. Returns those changes. Call it only once the command was accepted.
    """
    from kforge_cli.settings.explain import to_toml

    run = RunDir(run_dir)
    if not run.config.exists() or run.config.is_symlink():  # a planted link is replaced, never followed
        atomic_write(run.config, to_toml(with_run_dir(settings, run.path)).encode())
        return []
    changes = settings_changes(saved_settings(run.path), settings)
    if changes:
        record_changes(run.path, changes, command=command)
    return changes


def record_changes(run_dir: Path, changes: list[Change], *, command: str | None = None) -> None:
    """Append one record to RUN_DIR/config_changes.jsonl (flushed and synced: it is the run's record)."""
    record = {
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command if command is not None else shlex.join(["kforge", *sys.argv[1:]]),
        "changes": {key: {"from": old, "to": new} for key, old, new in changes},
    }
    with open_append(RunDir(run_dir).config_changes) as f:  # never through a planted link
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def record_layout_change(
    run_dir: Path, old: str, new: str, *, command: str | None = None, policy: str | None = None, reason: str = ""
) -> None:
    """Append a record of a change of the device mesh (no setting changed: ``changes`` is empty), typed
    or chosen by a ``policy`` (``slurm.min_nodes``: the shrink policy) for the ``reason`` given."""
    record: dict[str, object] = {
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command if command is not None else shlex.join(["kforge", *sys.argv[1:]]),
        "changes": {},
        "layout": {"from": old, "to": new},
    }
    if policy is not None:
        record |= {"policy": policy, "reason": reason}
    with open_append(RunDir(run_dir).config_changes) as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def describe_changes(changes: list[Change]) -> str:
    """`key: old -> new; ...` (for log lines and messages)."""
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes)
