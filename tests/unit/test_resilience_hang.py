"""The hang watchdog in one process: limits, firing, the report, and who the summary names."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from kforge_cli.engine.resilience.hang import HangWatchdog, step_limit_s
from kforge_cli.engine.resilience.hang_report import archive_previous, stopped_ranks, summarise
from kforge_cli.engine.runtime import process_group_timeout_s
from kforge_cli.errors import EXIT_HANG
from tests.helpers.tiny_run import tiny_settings


def test_the_automatic_limit_is_ten_median_steps_with_a_floor_and_a_cap() -> None:
    assert step_limit_s(None, 1.0, cap_s=1440) == 300  # the floor
    assert step_limit_s(None, 60.0, cap_s=1440) == 600
    assert step_limit_s(None, 200.0, cap_s=1440) == 1440  # below the process-group timeout
    assert step_limit_s(None, None, cap_s=1440) == 1440  # no step seen yet
    assert step_limit_s(7.5, 200.0, cap_s=1440) == 7.5  # explicit


def test_an_explicit_limit_raises_the_process_group_timeout_above_it() -> None:
    assert process_group_timeout_s(tiny_settings()) == 1800
    assert process_group_timeout_s(tiny_settings("--resilience.hang_timeout_s=5")) == 1800
    assert process_group_timeout_s(tiny_settings("--resilience.hang_timeout_s=3000")) == 3750
    assert process_group_timeout_s(tiny_settings("--distributed.timeout_s=60", "--resilience.hang_timeout_s=30")) == 90


class _Exit:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def _watchdog(tmp_path: Path, exit_fn: _Exit, timeout_s: float | None, pg_timeout_s: float = 600) -> HangWatchdog:
    return HangWatchdog(
        rank=0,
        world_size=1,
        directory=tmp_path / "hang",
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        exit_fn=exit_fn,
        gather_s=0.5,
    )


def test_a_stalled_phase_fires_after_the_limit_writes_the_report_and_exits_76(tmp_path: Path) -> None:
    exit_fn = _Exit()
    wd = _watchdog(tmp_path, exit_fn, timeout_s=0.3).start()
    try:
        for step in range(1, 6):  # steady steps: never fires
            wd.mark("forward/backward")
            time.sleep(0.05)
            wd.beat(step)
        assert not wd.fired.is_set()
        wd.mark("forward/backward")
        assert exit_fn.done.wait(10)
    finally:
        wd.stop()
    assert exit_fn.codes == [EXIT_HANG]
    facts = json.loads((tmp_path / "hang" / "rank_0.json").read_text())
    assert facts["step"] == 5 and facts["phase"] == "forward/backward" and facts["in_collective"] is False
    assert 0.3 < facts["idle_s"] < 5 and facts["limit_s"] == 0.3
    text = (tmp_path / "hang" / "rank_0.txt").read_text()
    assert "Thread MainThread" in text and "test_resilience_hang.py" in text  # the main thread's stack
    summary = (tmp_path / "hang" / "summary.txt").read_text()
    assert "1 of 1 ranks reported" in summary and "Exit code 76" in summary


def test_slow_phases_and_the_first_steps_get_the_cap_not_the_step_limit(tmp_path: Path) -> None:
    exit_fn = _Exit()
    wd = _watchdog(tmp_path, exit_fn, timeout_s=0.2, pg_timeout_s=1.0)  # cap 0.8 s
    assert wd.limit_s("forward/backward") == 0.8  # not armed: no step finished yet
    for step in range(1, 4):
        wd.beat(step)
    assert wd.limit_s("forward/backward") == 0.2
    assert wd.limit_s("checkpoint") == wd.limit_s("eval") == 0.8
    wd.start()
    try:
        wd.mark("checkpoint")
        time.sleep(0.5)  # longer than the step limit, within the cap
        assert not wd.fired.is_set()
        wd.mark("data")
        assert exit_fn.done.wait(10)
    finally:
        wd.stop()


def test_a_stopped_watchdog_never_fires(tmp_path: Path) -> None:
    exit_fn = _Exit()
    wd = _watchdog(tmp_path, exit_fn, timeout_s=0.1)
    for step in range(1, 4):
        wd.beat(step)
    wd.start()
    wd.stop()
    time.sleep(0.4)
    assert not exit_fn.codes and not (tmp_path / "hang").exists()


def _report(rank: int, *, in_collective: bool, seq: int, where: str = "x.py:1 in f") -> dict[str, object]:
    return {
        "rank": rank,
        "host": f"node{rank // 4}",
        "step": 7,
        "phase": "forward/backward",
        "idle_s": 310.0,
        "where": where,
        "in_collective": in_collective,
        "collective_frame": "torch/distributed/c10d.py:1 in all_reduce" if in_collective else None,
        "last_collectives": {"pg 0 (default_pg)": {"seq": seq, "op": "nccl:all_reduce", "state": "started"}},
    }


def test_the_summary_names_the_rank_that_is_behind_and_not_in_a_collective(tmp_path: Path) -> None:
    reports = {r: _report(r, in_collective=True, seq=42) for r in range(8)}
    reports[5] = _report(5, in_collective=False, seq=41, where="/x/kforge_cli/engine/data/loader.py:99 in __iter__")
    stopped, why = stopped_ranks(reports, 8)
    assert stopped == [5]
    assert "not in a collective" in why[5] and "did not enter nccl:all_reduce #42" in why[5]
    for r, rep in reports.items():
        (tmp_path / f"rank_{r}.json").write_text(json.dumps(rep))
    text = summarise(tmp_path, 8)
    assert (
        "Stopped: rank 5 (host node1): not in a collective: forward/backward at kforge_cli/engine/data/loader.py"
        in text
    )
    assert "Waiting in a collective: rank(s) 0, 1, 2, 3, 4, 6, 7" in text
    assert len(text.splitlines()) <= 24  # one screen


def test_a_rank_without_a_report_is_named_and_equal_ranks_name_nobody() -> None:
    reports = {r: _report(r, in_collective=True, seq=42) for r in (0, 1, 3)}
    stopped, why = stopped_ranks(reports, 4)
    assert stopped == [2] and "no report" in why[2]
    stopped, _ = stopped_ranks({r: _report(r, in_collective=True, seq=42) for r in range(4)}, 4)
    assert stopped == []


def test_an_earlier_report_is_moved_aside(tmp_path: Path) -> None:
    hang = tmp_path / "logs" / "hang"
    assert archive_previous(hang) is None
    hang.mkdir(parents=True)
    (hang / "summary.txt").write_text("first")
    assert archive_previous(hang) == tmp_path / "logs" / "hang.1"
    hang.mkdir()
    (hang / "summary.txt").write_text("second")
    assert archive_previous(hang) == tmp_path / "logs" / "hang.2"
    assert (tmp_path / "logs" / "hang.1" / "summary.txt").read_text() == "first"


@pytest.mark.parametrize("value", ["0.5", "1"])
def test_a_straggler_ratio_that_would_always_warn_is_refused(value: str) -> None:
    from kforge_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="resilience.straggler_ratio"):
        tiny_settings(f"--resilience.straggler_ratio={value}")


def test_stragglers_are_compared_only_among_ranks_holding_as_many_parameters() -> None:
    from kforge_cli.engine.resilience.straggler import worst_group

    # two pipeline stages (100 and 60 parameters per rank), two data-parallel ranks each
    rows = [[0.010, 100], [0.011, 100], [0.004, 60], [0.012, 60]]
    ratio, slowest, median = worst_group(rows)
    assert slowest == 3 and median == 0.004 and ratio == 3.0  # stage 2's slow rank, not stage 1's busier ones
    assert worst_group([[0.01, 100], [0.02, 60]]) is None  # nothing comparable
    assert worst_group([[0.01, 5], [0.01, 5]]) == (1.0, 0, 0.01)


# ---- hostile run directories (links planted in logs/hang) ------------------------------------


def _fire_once(directory: Path) -> _Exit:
    exit_fn = _Exit()
    wd = HangWatchdog(
        rank=0, world_size=1, directory=directory, timeout_s=0.1, pg_timeout_s=600, exit_fn=exit_fn, gather_s=0.3
    )
    for step in range(1, 4):
        wd.beat(step)
    wd.start()
    try:
        wd.mark("forward/backward")
        assert exit_fn.done.wait(10)
    finally:
        wd.stop()
    return exit_fn


def test_links_planted_at_the_reports_temporary_names_are_never_written_through(tmp_path: Path) -> None:
    import os

    hang = tmp_path / "run" / "logs" / "hang"
    hang.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name in ("rank_0.txt", "rank_0.json", "rank_0.fr_trace.pkl", "summary.txt"):
        (hang / f".{name}.{os.getpid()}.tmp").symlink_to(victim)  # the name the old writer used
    assert _fire_once(hang).codes == [EXIT_HANG]
    assert victim.read_text() == "precious\n"
    assert json.loads((hang / "rank_0.json").read_text())["rank"] == 0
    assert not (hang / "rank_0.json").is_symlink()


def test_a_hang_directory_that_is_a_link_gets_no_report_and_the_process_still_exits_76(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (logs / "hang").symlink_to(outside)
    with caplog.at_level("ERROR", logger="kforge"):
        assert _fire_once(logs / "hang").codes == [EXIT_HANG]
    assert list(outside.iterdir()) == []
    assert "symbolic link" in caplog.text and "Traceback" not in caplog.text


def test_a_logs_directory_that_is_a_link_gets_no_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "logs").symlink_to(outside)
    assert _fire_once(run / "logs" / "hang").codes == [EXIT_HANG]
    assert list(outside.iterdir()) == []


def test_a_summary_or_report_planted_as_a_link_is_never_read(tmp_path: Path) -> None:
    from kforge_cli.engine.train.recipe import previous_hang_note

    secret = tmp_path / "secret"
    secret.write_text("PRIVATE-FIRST-LINE\n")
    hang = tmp_path / "logs" / "hang"
    hang.mkdir(parents=True)
    (hang / "summary.txt").symlink_to(secret)
    moved, first = previous_hang_note(tmp_path)
    assert moved == tmp_path / "logs" / "hang.1"
    assert "PRIVATE" not in first and "link" in first
    leak = tmp_path / "leak.json"
    leak.write_text(json.dumps(_report(0, in_collective=False, seq=1) | {"host": "PRIVATE-HOST"}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "rank_0.json").symlink_to(leak)
    assert "PRIVATE-HOST" not in summarise(other, 1)
