"""RUN_DIR/data_positions.jsonl: written by rank 0 when a job starts and at a rewind, read back untrusted."""

from __future__ import annotations

from pathlib import Path

import pytest

from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.data_positions import read_data_positions, record_data_position


def test_records_read_back_with_the_changes_in_force_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    data = {"batch": 4, "sample": 8, "counts": [8], "dp_size": 2}
    record_data_position(tmp_path, step=0, reason="start", data=data, world_size=2)
    (tmp_path / "config_changes.jsonl").write_text('{"changes": {"train.max_steps": {"from": 2, "to": 4}}}\n')
    skip = {"spike_step": 5, "detected_at": 5, "rewound_to": 2, "skipped_steps": 3}
    record_data_position(tmp_path, step=2, reason="rewind", data=data, world_size=1, skip=skip)
    with (tmp_path / "data_positions.jsonl").open("a") as f:
        f.write('{"step": 7, "da')  # a process killed while appending
    first, second = read_data_positions(tmp_path)
    assert (first.step, first.reason, first.config_changes, first.world_size, first.skip) == (0, "start", 0, 2, None)
    assert (second.step, second.reason, second.config_changes, second.line) == (2, "rewind", 1, 2)
    assert second.data == data and second.skip == skip
    assert read_data_positions(tmp_path / "none") == []


def test_a_damaged_line_is_an_error_naming_it_and_a_planted_link_is_never_written_through(tmp_path: Path) -> None:
    path = tmp_path / "data_positions.jsonl"
    path.write_text('["not a record"]\n{"step": 1, "data": {}}\n')
    with pytest.raises(InvalidInputError, match=r"data_positions.jsonl:1 is not a data position record"):
        read_data_positions(tmp_path)
    path.unlink()
    target = tmp_path / "elsewhere"
    target.write_text("")
    path.symlink_to(target)
    with pytest.raises(InvalidInputError):
        record_data_position(tmp_path, step=0, reason="start", data={}, world_size=1)
    assert target.read_text() == ""
