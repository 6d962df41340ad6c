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
