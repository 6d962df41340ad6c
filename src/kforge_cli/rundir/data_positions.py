"""Where a run's data order stood each time training began from a step: ``RUN_DIR/data_positions.jsonl``.

The data order is a pure function of the data loader's position (`engine.data.sampler`), so
what any step read follows from the position its job began at, the settings in force then and
the number of data-parallel ranks. Rank 0 appends one JSON line when a job has restored its
checkpoint (``"reason": "start"``) and when a loss-spike rewind moves the loader past the data
it skips (``"rewind"``)::

    {"time": "...", "reason": "start", "step": 40, "config_changes": 2, "world_size": 4,
     "data": {<the loader's state_dict(): position, batch size, dp size, accumulation, ...>}}

``config_changes`` counts the records of ``config_changes.jsonl`` in force (the job's settings
are config.toml plus that many changes, `rundir.saved_config`). A later line supersedes earlier
ones from its step on: step N of the run was read from the last line whose step is below N
(`kforge data-trace`). Imports no torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.common.files import MAX_TOML_BYTES, open_append, read_text_capped
from kforge_cli.common.json_values import dict_of, int_of
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.saved_config import read_changes


@dataclass(frozen=True)
class DataPosition:
    """One line of data_positions.jsonl: from `step` on, the loader stood at `data`."""

    step: int
    reason: str  # "start" (a job restored its checkpoint, or began a new run) or "rewind"
    config_changes: int  # records of config_changes.jsonl in force
    world_size: int | None
    data: dict[str, object]  # the loader's state_dict()
    line: int  # 1-based line number in the file (for messages)
    skip: dict[str, object] | None = None  # a rewind's record: spike_step, detected_at, rewound_to, skipped_steps


def record_data_position(
    run_dir: Path,
    *,
    step: int,
    reason: str,
    data: Mapping[str, object],
    world_size: int | None,
    skip: Mapping[str, object] | None = None,
) -> None:
    """Append one line (rank 0 only; flushed and synced: it is the run's record). ``skip``: a rewind's."""
    run = RunDir(run_dir)
    record: dict[str, object] = {
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "reason": reason,
        "step": step,
        "config_changes": len(read_changes(run.path)),
        "world_size": world_size,
        "data": dict(data),
    }
    if skip is not None:
        record["skip"] = dict(skip)
    with open_append(run.data_positions) as f:  # never through a planted link
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_data_positions(run_dir: Path) -> list[DataPosition]:
    """The records, oldest first ([] when the file is absent); a torn last line is skipped, any other
    unreadable line is an error naming the file and line."""
    path = RunDir(run_dir).data_positions
    try:
        lines = read_text_capped(path, 16 * MAX_TOML_BYTES, "data positions file").splitlines()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path} is unreadable ({exc})") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = dict_of(json.loads(line), "a record")
            world, skip = record.get("world_size"), record.get("skip")
            out.append(
                DataPosition(
                    step=int_of(record["step"]),
                    reason=str(record.get("reason", "start")),
                    config_changes=int_of(record.get("config_changes", 0)),
                    world_size=None if world is None else int_of(world),
                    data=dict_of(record["data"], "data"),
                    line=number,
                    skip=None if skip is None else dict_of(skip, "skip"),
                )
            )
        except (ValueError, TypeError, KeyError, RecursionError):
            if number == len(lines):
                continue  # a process killed while appending: a record that was never written
            raise InvalidInputError(f"{path}:{number} is not a data position record (a damaged line)") from None
    return out
