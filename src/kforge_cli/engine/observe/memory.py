"""Peak memory of this process, for the metrics file and the memory planner's checks.

On CUDA the number that matters is the allocator's peak (what decides an OOM); on a
CPU run it is the process's resident set. The RSS peak comes from the kernel and
cannot be reset, so it is the peak since the process started.
"""

from __future__ import annotations

import resource
import sys

import torch

_GIB = 1024**3


def _max_rss_bytes() -> int:
    """The process's peak resident set size in bytes (Linux reports KiB, macOS bytes)."""
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024


def peak_memory_stats(device: torch.device) -> dict[str, float]:
    """``peak_rss_gib`` always; on CUDA also ``peak_mem_gib`` (allocated) and ``peak_reserved_gib``.

    The reserved peak next to the allocated one shows allocator fragmentation.
    """
    stats = {"peak_rss_gib": _max_rss_bytes() / _GIB}
    if device.type == "cuda" and torch.cuda.is_available():
        stats["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        stats["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / _GIB
    return stats


def reset_peak_memory(device: torch.device) -> None:
    """Start a new CUDA peak window (e.g. after warm-up); a no-op on CPU, whose RSS peak cannot be reset."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
