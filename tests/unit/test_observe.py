"""engine.observe: per-rank logs, metrics.jsonl, MFU table, progress lines, profiler window, memory."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kforge_cli.engine.observe import (
    SKIP_CONSOLE,
    MetricsFile,
    ProgressReporter,
    TrainProfiler,
    build_profiler,
    device_peak_flops,
    mfu,
    peak_flops,
    peak_memory_stats,
    read_metrics,
    reset_peak_memory,
    setup_logging,
    shutdown_logging,
)
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.infrastructure import ProfilingSettings

LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]\[rank (\d+)\]\[(\w+)\] (.*)$")


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    yield
    shutdown_logging()


# --- logging -----------------------------------------------------------------------


def test_log_lines_carry_rank_and_go_to_the_rank_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = setup_logging(rank=3, world_size=4, log_dir=tmp_path / "logs", level="INFO")
    logger.info("hello")
    logger.warning("careful")
    logger.debug("hidden at INFO")
    shutdown_logging()

    lines = (tmp_path / "logs" / "rank_3.log").read_text().splitlines()
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [m.groups() for m in parsed if m] == [("3", "INFO", "hello"), ("3", "WARNING", "careful")]
    # A non-zero rank prints only warnings to the console.
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("[rank 3][WARNING] careful")


def test_rank0_prints_info_and_skip_console_records_only_reach_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = setup_logging(rank=0, world_size=2, log_dir=tmp_path, level="info")
    logger.info("to both")
    logger.info("file only", extra={SKIP_CONSOLE: True})
    shutdown_logging()
    err = capsys.readouterr().err
    assert "[rank 0][INFO] to both" in err and "file only" not in err
    text = (tmp_path / "rank_0.log").read_text()
    assert "[rank 0][INFO] to both" in text and "[rank 0][INFO] file only" in text


def test_setup_twice_does_not_duplicate_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(0, 1, tmp_path, "INFO")
    logger = setup_logging(0, 1, tmp_path, "INFO")
    # (pytest attaches its own capture handlers to non-propagating loggers: count only files.)
    assert sum(isinstance(h, logging.FileHandler) for h in logger.handlers) == 1
    logger.info("once")
    shutdown_logging()
    assert (tmp_path / "rank_0.log").read_text().count("once") == 1
    assert capsys.readouterr().err.count("once") == 1


def test_unknown_log_level_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="VERBOSE"):
        setup_logging(0, 1, tmp_path, "VERBOSE")


# --- metrics.jsonl -------------------------------------------------------------------


def _strict_loads(line: str) -> dict:
    def reject(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


def test_metrics_file_appends_across_writers_with_null_for_nan_and_a_time(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    before = time.time()
    with MetricsFile(path) as first:
        first.write({"step": 1, "loss": 2.5, "lr": 1e-3})
    second = MetricsFile(path)  # a resumed run continues the same file
    second.write({"step": 2, "loss": float("nan"), "grad_norm": float("inf"), "time": 123.5})
    second.write({"step": 2, "eval_loss": torch.tensor(1.25), "extra": {"per_source": [float("-inf"), 0.5]}})
    second.close()
    second.close()  # idempotent
    after = time.time()

    lines = path.read_text().splitlines()
    assert len(lines) == 3
    records = [_strict_loads(line) for line in lines]
    assert records == read_metrics(path)
    assert records[0]["step"] == 1 and records[0]["loss"] == 2.5 and records[0]["lr"] == 1e-3
    assert isinstance(records[0]["time"], float) and before <= records[0]["time"] <= after
    assert records[1] == {"step": 2, "loss": None, "grad_norm": None, "time": 123.5}
    assert records[2]["eval_loss"] == 1.25 and records[2]["extra"] == {"per_source": [None, 0.5]}


def test_metrics_file_isolates_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')  # killed mid-write
    with MetricsFile(path) as f:
        f.write({"step": 2, "loss": 2.0, "time": 1.0})
    assert read_metrics(path) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "time": 1.0}]


def test_metrics_file_rejects_unserialisable_values_and_writes_after_close(tmp_path: Path) -> None:
    f = MetricsFile(tmp_path / "m.jsonl")
    with pytest.raises(TypeError, match="not JSON serialisable"):
        f.write({"step": 1, "bad": object()})
    f.close()
    with pytest.raises(RuntimeError, match="closed"):
        f.write({"step": 1})
    assert read_metrics(tmp_path / "m.jsonl") == []


# --- MFU ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200", "torch.float8_e4m3fn", 1978.9),
        ("NVIDIA GH200 480GB", "bfloat16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
    ],
)
def test_peak_flops_table(name: str, dtype: str, tflops: float) -> None:
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("NVIDIA GeForce GTX 1080", "bf16"), ("cpu", "bf16"), ("NVIDIA A100-SXM4-80GB", "fp8"), ("NVIDIA H200", "int4")],
)
def test_peak_flops_unknown_is_none(name: str, dtype: str) -> None:
    assert peak_flops(name, dtype) is None


def test_device_peak_flops_on_cpu_only_with_override() -> None:
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, "bf16", None) is None
    assert device_peak_flops(cpu, "bf16", 100.0) == pytest.approx(1e14)


def test_mfu_arithmetic() -> None:
    # A 7B model (6 * 7e9 FLOPs/token) at 3,000 tok/s per GPU on 8 H100s:
    # 4.2e10 * 24,000 / (8 * 989.4e12) = 1.008e15 / 7.9152e15 = 0.12734990...
    value = mfu(6 * 7e9, 24_000.0, 8, 989.4e12)
    assert value == pytest.approx(0.1273499090, rel=1e-9)
    assert mfu(1e9, 1.0, 1, None) is None
    assert mfu(1e9, 1.0, 0, 1e12) is None


# --- progress ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_plain_lines_with_eta_from_this_process(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kforge_test.progress")
    clock = FakeClock()
    progress = ProgressReporter(300, 0, "off", True, logger, clock=clock)
    with caplog.at_level(logging.INFO, logger=logger.name), progress:
        assert not progress.uses_bar
        clock.now = 10.0  # 10 steps in 10 s -> 1 s/step, 290 left
        progress.update(10, {"loss": 2.34561, "lr": 3e-3, "grad_norm": 0.8123, "tokens_per_sec": 12345.4})
        clock.now = 30.0  # since the first update: 10 steps in 20 s -> 2 s/step, 280 left
        progress.update(20, {"loss": 2.0, "tokens_per_sec": 1000.0, "mfu": 0.4123})
        progress.log_eval(20, 2.0)
    assert [r.getMessage() for r in caplog.records] == [
        "step 10/300 | loss 2.3456 | lr 3.0e-03 | grad_norm 0.812 | 12,345 tok/s | eta 0:04:50",
        "step 20/300 | loss 2.0000 | 1,000 tok/s | mfu 41.2% | eta 0:09:20",
        "eval step 20/300 | eval_loss 2.0000 | ppl 7.39",
    ]


def test_progress_eta_ignores_steps_done_before_a_resume(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kforge_test.progress")
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger=logger.name):
        progress = ProgressReporter(300, 100, "auto", True, logger, clock=clock)
        clock.now = 5.0  # one step in this process took 5 s; 199 steps left
        progress.update(101, {"loss": 1.5})
        progress.close()
    assert [r.getMessage() for r in caplog.records] == ["step 101/300 | loss 1.5000 | eta 0:16:35"]


def test_progress_disabled_is_a_noop(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kforge_test.progress")
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        with ProgressReporter(10, 0, "on", False, logger) as progress:
            progress.update(1, {"loss": 1.0})
            progress.log_eval(1, 1.0)
        assert not progress.uses_bar
    assert caplog.records == []


def test_progress_bar_mode_keeps_a_permanent_loss_line_per_log_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bar, each logged step's loss line stays in the terminal's scrollback (printed above the bar)."""
    import io
    import sys

    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal, as far as rich is concerned
    monkeypatch.setenv("COLUMNS", "120")
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = setup_logging(0, 1, None)
    try:
        with ProgressReporter(30, 0, "on", True, logger) as progress:
            assert progress.uses_bar
            for step, loss in ((10, 3.25), (20, 2.5), (30, 2.125)):
                progress.update(step, {"loss": loss})
    finally:
        shutdown_logging()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue()).splitlines()
    kept = [line.split("[INFO] ")[1].split(" | eta")[0] for line in shown if "[INFO] step " in line]
    assert kept == ["step 10/30 | loss 3.2500", "step 20/30 | loss 2.5000", "step 30/30 | loss 2.1250"], shown


def test_log_lines_above_a_live_bar_keep_a_long_run_dir_path_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal, as far as rich is concerned: the bar redirects stderr
    monkeypatch.setenv("COLUMNS", "80")
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = setup_logging(0, 1, None)
    run_dir = "/scratch/" + "/".join(["a_long_project_directory"] * 6) + "/runs/cpu-debug-20260101-000000-2"
    try:
        with ProgressReporter(10, 0, "on", True, logger) as progress:
            assert progress.uses_bar
            logger.info("checkpoint step 5 -> %s", run_dir)
            progress.update(5, {"loss": 1.0})
    finally:
        shutdown_logging()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue()).splitlines()
    assert any(f"checkpoint step 5 -> {run_dir}" in line for line in shown), shown


def test_progress_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="sometimes"):
        ProgressReporter(10, 0, "sometimes", True, logging.getLogger("kforge_test.progress"))


# --- profiler --------------------------------------------------------------------------------


def _run_steps(profiler: TrainProfiler, steps: range) -> None:
    a = torch.randn(32, 32)
    for step in steps:
        torch.mm(a, a).sum()
        profiler.step(step)


def _profiler_step_labels(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}


def test_profiler_writes_one_trace_for_the_window(tmp_path: Path) -> None:
    cfg = ProfilingSettings(enabled=True, start_step=2, end_step=4)
    with build_profiler(cfg, tmp_path, rank=1) as profiler:
        _run_steps(profiler, range(1, 7))
    trace = tmp_path / "profile" / "rank1_step4.json"
    assert profiler.trace_paths == [trace]
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank1_step4.json"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert _profiler_step_labels(trace) == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}


def test_profiler_resumed_inside_the_window_records_the_rest(tmp_path: Path) -> None:
    cfg = ProfilingSettings(enabled=True, start_step=2, end_step=4, trace_dir=str(tmp_path / "traces"))
    profiler = build_profiler(cfg, tmp_path, rank=0, first_step=3)
    _run_steps(profiler, range(3, 6))
    profiler.close()
    assert profiler.trace_paths == [tmp_path / "traces" / "rank0_step4.json"]
    assert _profiler_step_labels(profiler.trace_paths[0]) == {"ProfilerStep#3", "ProfilerStep#4"}


def test_profiler_past_the_window_or_disabled_writes_nothing(tmp_path: Path) -> None:
    past = build_profiler(ProfilingSettings(enabled=True, start_step=2, end_step=3), tmp_path, 0, first_step=4)
    _run_steps(past, range(4, 6))
    past.close()
    # Not told the resume step: it starts at the window, sees step 9, and drops the trace.
    unaware = build_profiler(ProfilingSettings(enabled=True, start_step=1, end_step=2), tmp_path, 0)
    _run_steps(unaware, range(9, 11))
    unaware.close()
    disabled = build_profiler(ProfilingSettings(enabled=False, start_step=1, end_step=2), tmp_path, 0)
    assert not disabled.enabled
    _run_steps(disabled, range(1, 4))
    disabled.close()
    assert past.trace_paths == unaware.trace_paths == disabled.trace_paths == []
    assert not (tmp_path / "profile").exists()


# --- memory -----------------------------------------------------------------------------------


def test_peak_memory_on_cpu_reports_rss_only() -> None:
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    stats = peak_memory_stats(cpu)
    assert set(stats) == {"peak_rss_gib"}
    # This process has torch imported: its peak RSS is above 50 MiB and below 64 GiB.
    assert 50 / 1024 < stats["peak_rss_gib"] < 64
    assert not math.isnan(stats["peak_rss_gib"])


@pytest.mark.gpu
def test_peak_memory_on_cuda_tracks_an_allocation() -> None:
    dev = torch.device("cuda")
    reset_peak_memory(dev)
    x = torch.empty(256 * 1024**2, dtype=torch.uint8, device=dev)  # 0.25 GiB
    stats = peak_memory_stats(dev)
    del x
    assert stats["peak_mem_gib"] >= 0.25
    assert stats["peak_reserved_gib"] >= stats["peak_mem_gib"]
    assert peak_flops(torch.cuda.get_device_name(dev), "bf16") == device_peak_flops(dev, "bf16", None)
