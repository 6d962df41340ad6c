"""CUDA memory snapshots (profiling.memory_snapshot_steps; the allocator's state at an OOM).

On CPU: the setting is refused (the settings rules for train.device = cpu, the run for a device
that resolved to the CPU), and the snapshot logic runs against stand-ins for torch's recording
functions. On CUDA (gpu marker): a real run writes a snapshot memory viz can read, and an
out-of-memory error writes the allocator's state, named in the error message."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from kforge_cli.engine.observe import build_profiler, memory_snapshot
from kforge_cli.errors import ConfigError
from kforge_cli.settings import load_settings
from kforge_cli.settings.infrastructure import ProfilingSettings
from tests.helpers import tiny

SNAPSHOTS = ProfilingSettings(memory_snapshot_steps=2, memory_snapshot_max_entries=5000)


def test_the_setting_is_refused_on_cpu_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(None, overrides=["--train.device=cpu", "--profiling.memory_snapshot_steps=3"])
    assert "profiling.memory_snapshot_steps" in str(err.value) and "train.device is cpu" in str(err.value)
    assert err.value.exit_code == 2
    load_settings(None, overrides=["--train.device=cuda", "--profiling.memory_snapshot_steps=3"])  # fine on CUDA
    with pytest.raises(ConfigError, match="memory_snapshot_max_entries"):
        load_settings(None, overrides=["--profiling.memory_snapshot_max_entries=0"])


def test_a_run_whose_device_resolved_to_the_cpu_refuses_it_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"profiling\.memory_snapshot_steps.*no CUDA device"):
        build_profiler(SNAPSHOTS, tmp_path, 0, device=torch.device("cpu"))
    plain = build_profiler(ProfilingSettings(), tmp_path, 0, device=torch.device("cpu"))
    assert type(plain).__name__ == "TrainProfiler"  # nothing wrapped, nothing watched on CPU


class FakeCudaMemory:
    """Stands in for torch.cuda.memory's recording functions; records the calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.dumped: list[str] = []

    def record(self, enabled: str | None = "all", **kwargs: Any) -> None:
        self.calls.append({"enabled": enabled, **kwargs})

    def dump(self, filename: str) -> None:
        self.dumped.append(filename)
        Path(filename).write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}]]}))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCudaMemory:
    f = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", f.record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", f.dump)
    monkeypatch.setattr(memory_snapshot._OomWatch, "attached", True)  # no real observer on a CPU build
    return f


def test_the_first_n_steps_are_recorded_then_written_once(tmp_path: Path, fake: FakeCudaMemory) -> None:
    with build_profiler(SNAPSHOTS, tmp_path, 1, first_step=3, device=torch.device("cuda")) as profiler:
        assert fake.calls == [{"enabled": "all", "stacks": "python", "max_entries": 5000}]
        for step in range(3, 7):
            profiler.step(step)
    path = tmp_path / "memory" / "rank1_steps3-4.pickle"
    assert profiler.snapshot_paths == [path]  # type: ignore[attr-defined]
    assert pickle.loads(path.read_bytes())["device_traces"] == [[{"action": "alloc"}]]
    assert [c["enabled"] for c in fake.calls] == ["all", None]  # stopped after step 4, not again at close
    assert len(fake.dumped) == 1 and sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_a_run_ending_inside_the_window_still_writes_it(tmp_path: Path, fake: FakeCudaMemory) -> None:
    cfg = ProfilingSettings(memory_snapshot_steps=10, enabled=True, start_step=1, end_step=1)
    profiler = build_profiler(cfg, tmp_path, 0, device=torch.device("cuda"))
    profiler.step(1)
    profiler.step(2)
    profiler.close()
    assert profiler.snapshot_paths == [tmp_path / "memory" / "rank0_steps1-2.pickle"]  # type: ignore[attr-defined]
    assert profiler.trace_paths == [tmp_path / "profile" / "rank0_step1.json"]  # the torch.profiler window too
    assert fake.calls[-1]["enabled"] is None


def test_a_planted_link_is_never_written_through(tmp_path: Path, fake: FakeCudaMemory) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    os.symlink(elsewhere, tmp_path / "run" / "memory")
    profiler = build_profiler(SNAPSHOTS, tmp_path / "run", 0, device=torch.device("cuda"))
    profiler.step(1)
    with pytest.raises(Exception, match="link"):
        profiler.step(2)
    profiler.close()
    assert list(elsewhere.iterdir()) == [] and fake.calls[-1]["enabled"] is None  # recording stopped anyway


def test_an_oom_writes_the_allocator_state_once_and_the_message_names_it(
    tmp_path: Path, fake: FakeCudaMemory, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.app import _not_a_bug

    profiler = build_profiler(ProfilingSettings(), tmp_path, 3, device=torch.device("cuda"))
    assert fake.calls == []  # no history without the setting: the OOM snapshot has no stacks
    memory_snapshot._on_oom(0, 2**31, 2**30, 0)
    memory_snapshot._on_oom(0, 2**31, 2**30, 0)  # the error's unwinding may fail again: written once
    path = tmp_path / "memory" / "rank3_oom.pickle"
    assert memory_snapshot.oom_snapshot_path() == path and len(fake.dumped) == 1 and path.is_file()
    profiler.close()
    assert _not_a_bug(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    err = capsys.readouterr().err
    assert f"The allocator's state at the error: {path} (open it at https://pytorch.org/memory_viz)" in err
    memory_snapshot._on_oom(0, 1, 1, 0)  # after the run: nothing watched, nothing written
    assert len(fake.dumped) == 1
    build_profiler(ProfilingSettings(), tmp_path / "next", 0, device=torch.device("cuda")).close()
    assert memory_snapshot.oom_snapshot_path() is None  # a new run forgets the last one's file


@pytest.mark.gpu
def test_cuda_run_writes_a_memory_viz_snapshot_and_an_oom_snapshot(tmp_path: Path) -> None:
    from kforge_cli.engine.train import run_training

    overrides = [
        *tiny.model(64, 2, 4, 2, max_seq_len=64),
        "--train.seq_len=64",
        "--train.device=cuda",
        *tiny.QUIET,
        "--train.max_steps=3",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        "--profiling.memory_snapshot_steps=2",
        f"--train.run_dir={tmp_path / 'run'}",
    ]
    run_training(load_settings(None, overrides=overrides).settings)
    snap = pickle.loads((tmp_path / "run" / "memory" / "rank0_steps1-2.pickle").read_bytes())
    assert snap["segments"] and any(snap["device_traces"])  # what memory viz draws: segments and the timeline
    frames = [f for trace in snap["device_traces"] for e in trace for f in e.get("frames", [])]
    assert any("kforge_cli" in f.get("filename", "") for f in frames)  # with Python stacks
    memory_snapshot.watch_oom(tmp_path / "oom", 0)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2**50, dtype=torch.uint8, device="cuda")
    memory_snapshot.unwatch_oom()
    assert memory_snapshot.oom_snapshot_path() == tmp_path / "oom" / "rank0_oom.pickle"
    assert "segments" in pickle.loads((tmp_path / "oom" / "rank0_oom.pickle").read_bytes())
