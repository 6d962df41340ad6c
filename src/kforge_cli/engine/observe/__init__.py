"""engine.observe: what a run tells its user. Per-rank logging, ``metrics.jsonl`` and the
experiment trackers (W&B, MLflow, imported lazily), MFU, the progress bar, the
torch.profiler window and peak memory (layer 1: torch, rich, settings and errors only)."""

from kforge_cli.engine.observe.logs import SKIP_CONSOLE, get_logger, setup_logging, shutdown_logging
from kforge_cli.engine.observe.memory import peak_memory_stats, reset_peak_memory
from kforge_cli.engine.observe.metrics_file import MetricsFile, read_metrics
from kforge_cli.engine.observe.mfu import PEAK_TFLOPS, device_peak_flops, mfu, peak_flops
from kforge_cli.engine.observe.profiler import TrainProfiler, WindowProfiler, build_profiler
from kforge_cli.engine.observe.progress import ProgressReporter, format_metrics
from kforge_cli.engine.observe.tracker import Tracker, TrackerStatus, build_tracker

__all__ = [
    "PEAK_TFLOPS",
    "SKIP_CONSOLE",
    "MetricsFile",
    "ProgressReporter",
    "Tracker",
    "TrackerStatus",
    "TrainProfiler",
    "WindowProfiler",
    "build_profiler",
    "build_tracker",
    "device_peak_flops",
    "format_metrics",
    "get_logger",
    "mfu",
    "peak_flops",
    "peak_memory_stats",
    "read_metrics",
    "reset_peak_memory",
    "setup_logging",
    "shutdown_logging",
]
