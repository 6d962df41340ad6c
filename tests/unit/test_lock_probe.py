"""`kforge runs` asks whether a run lives without taking its lock (issue 41)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from kforge_cli.rundir.lock import acquire_run_lock, probe_run_lock


def test_the_probe_sees_a_held_lock_and_a_free_one(tmp_path: Path) -> None:
    assert probe_run_lock(tmp_path) is False  # no lock file: no job ever took it
    lock = acquire_run_lock(tmp_path, wait_s=0)
    assert probe_run_lock(tmp_path) is True
    lock.release()
    assert probe_run_lock(tmp_path) is False  # its holder ran here and holds nothing now


def test_the_probe_never_makes_a_starting_run_fail(tmp_path: Path) -> None:
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            probe_run_lock(tmp_path)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        for _ in range(300):  # each would raise RunDirInUseError if a probe held the lock at that moment
            acquire_run_lock(tmp_path, wait_s=0).release()
    finally:
        stop.set()
        prober.join()


def test_a_holder_on_another_host_or_no_lock_table_falls_back_to_the_records(tmp_path: Path) -> None:
    lock_file = tmp_path / ".kforge-lock"
    lock_file.write_text(json.dumps({"pid": 1, "host": "node-17", "since": "x"}))
    assert probe_run_lock(tmp_path) is None  # this host's lock table cannot see node-17
    missing = tmp_path / "no-proc-locks"
    lock_file.write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(), "since": "x"}))
    assert probe_run_lock(tmp_path, proc_locks=missing) is False  # the record's process is gone
    lock = acquire_run_lock(tmp_path, wait_s=0)  # writes this process's record
    try:
        assert probe_run_lock(tmp_path, proc_locks=missing) is True  # the record's process lives
    finally:
        lock.release()


def test_runs_statuses_from_exit_records_and_the_lock(tmp_path: Path) -> None:
    from kforge_cli.cli.runs_table import describe_run
    from kforge_cli.rundir.launch import write_exit

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "config.toml").write_text("[train]\nmax_steps = 10\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 2.0}) + "\n")  # written just now
    acquire_run_lock(run, wait_s=0).release()  # a job took the lock and is gone, without a record
    assert describe_run(run).status == "killed"  # not "running" for five minutes
    (run / "logs" / "hang").mkdir()
    (run / "logs" / "hang" / "summary.txt").write_text("rank 1 hung in all_reduce\n")
    assert describe_run(run).status == "hung (watchdog)"  # one process's watchdog exits without a record
    for code, status in ((0, "done"), (75, "stopped (signal)"), (76, "hung (watchdog)"), (130, "interrupted")):
        write_exit(run, code, 4)
        assert describe_run(run).status == status
    write_exit(run, 1)
    assert (describe_run(run).status, describe_run(run).steps_done) == ("failed", 4)
    lock = acquire_run_lock(run, wait_s=0)
    try:
        assert describe_run(run).status == "running"
    finally:
        lock.release()
