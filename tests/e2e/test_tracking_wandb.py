"""W&B tracking for real, offline: `kforge train` writes a W&B offline run; a preempted and
requeued job writes a second offline run directory with the SAME run id (what `wandb
sync` uploads as one run). No network: WANDB_MODE=offline, every W&B directory in tmp.

The offline run is W&B's own record file (``run-ID.wandb``: a LevelDB-style log of
protobuf records); it is decoded here with W&B's protobuf classes.
"""

from __future__ import annotations

import json
import re
import struct
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_tracking_hooks import HOOKS, TINY, hook_env, numeric_metrics

pytestmark = pytest.mark.e2e
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """Every protobuf ``Record`` of an offline ``.wandb`` file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B record file"
    pos, pending = 7, b""  # after the header: ident, magic, version
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            yield record


def item_key(item: Any) -> str:
    """W&B writes a key either flat (``key``) or as a path (``nested_key``)."""
    return item.key or "/".join(item.nested_key)


def read_offline_run(run_dir: Path) -> dict[str, Any]:
    (path,) = run_dir.glob("run-*.wandb")
    out: dict[str, Any] = {"history": {}, "exit_code": None, "preempting": False, "run": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
        elif kind == "history":
            row = {item_key(item): json.loads(item.value_json) for item in record.history.item}
            out["history"][row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
        elif kind == "preempting":
            out["preempting"] = True
    return out


def test_offline_run_continues_under_the_same_id_after_preemption(kforge, tmp_path: Path) -> None:
    n = 3
    run_dir, wandb_root = tmp_path / "run", tmp_path / "wandb_root"
    env = hook_env(
        WANDB_MODE="offline",
        WANDB_DIR=str(wandb_root),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
    )
    args = [
        "train",
        "--run-dir",
        str(run_dir),
        f"--train.max_steps={2 * n}",
        "--eval.interval=2",
        "--eval.steps=2",
        "--checkpoint.interval=2",
        f'--train.hooks=["{HOOKS}:SigtermAt"]',
        '--metrics.backends=["jsonl","wandb"]',
        "--metrics.wandb_project=kforge-e2e",
        "--metrics.wandb_group=g1",
        '--metrics.tags=["e2e","offline"]',
        *TINY,
    ]
    first = kforge(*args, env={**env, "KFORGE_TEST_SIGTERM_AT": str(n)})
    assert first.returncode == 75, first.stderr[-3000:]
    said = re.search(
        r"wandb: logging OFFLINE \(WANDB_MODE=offline\): started run (\w+) in (\S+); "
        r"upload it later with `wandb sync (\S+)`",
        first.stderr,
    )
    assert said, first.stderr[-3000:]
    run_id, sync_dir = said.group(1), Path(said.group(2))
    assert said.group(3) == str(sync_dir) and sync_dir.parent == wandb_root / "wandb"

    second = kforge(*args, env=env)  # the requeued job: same command; the id comes from the checkpoint
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"continuing run {run_id}" in second.stderr

    dirs = sorted((wandb_root / "wandb").glob("offline-run-*"))
    assert [d.name.rsplit("-", 1)[1] for d in dirs] == [run_id, run_id] and dirs[0] == sync_dir
    stopped, finished = read_offline_run(dirs[0]), read_offline_run(dirs[1])
    assert (stopped["exit_code"], stopped["preempting"]) == (75, True)
    assert (finished["exit_code"], finished["preempting"]) == (0, False)

    config_toml = tomllib.loads((run_dir / "config.toml").read_text())
    for part in (stopped, finished):
        run = part["run"]
        assert (run.run_id, run.project, run.run_group, run.display_name) == (run_id, "kforge-e2e", "g1", "run")
        assert list(run.tags) == ["e2e", "offline"]
        config = {item_key(i): json.loads(i.value_json) for i in run.config.update if item_key(i) != "_wandb"}
        for section, table in config_toml.items():  # the TOML leaves out None values; W&B has them all
            if isinstance(table, dict):
                assert {k: config[section][k] for k in table} == table, section
            else:
                assert config[section] == table
        assert config["train"]["max_steps"] == 2 * n and config["metrics"]["wandb_run_id"] is None

    steps = {**stopped["history"], **finished["history"]}
    assert sorted(stopped["history"]) == list(range(1, n + 1))
    assert sorted(finished["history"]) == list(range(n + 1, 2 * n + 1))
    expected: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        expected.setdefault(rec["step"], {}).update(numeric_metrics(rec))
    for step, values in expected.items():
        got = {k: v for k, v in steps[step].items() if k != "checkpoint_step"}
        assert got == pytest.approx(values, rel=1e-12), step
    assert sorted(s for s, row in steps.items() if "checkpoint_step" in row) == [2, 3, 4, 6]
    assert all(steps[s]["checkpoint_step"] == s for s in (2, 3, 4, 6))
