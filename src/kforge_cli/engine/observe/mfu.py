"""Model FLOP utilisation: achieved FLOP/s over the hardware's peak.

MFU compares runs across cluster sizes and parallelism layouts, which tokens/s
alone cannot. The peak is the vendor's *dense* tensor-core number (the datasheet's
"with sparsity" figure halved), per device and per compute dtype. A device not in
the table gives ``None`` (MFU is then omitted rather than wrong); the user can set
``metrics.peak_tflops`` instead.

Note that fp32 matmuls run on tensor cores as TF32 when
``torch.backends.cuda.matmul.allow_tf32`` is on: pass ``"tf32"`` then.
"""

from __future__ import annotations

import torch

from kforge_cli.engine.runtime.device_peaks import PEAK_TFLOPS, match_device, peak_flops

__all__ = ["PEAK_TFLOPS", "device_peak_flops", "match_device", "mfu", "peak_flops"]

_T = 1e12


def device_peak_flops(device: torch.device, dtype: str, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of ``device``: the user's override, else the table (CUDA only).

    A CPU has no meaningful tensor-core peak, so it gets ``None`` unless overridden.
    """
    if override_tflops is not None:
        return override_tflops * _T
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


def mfu(flops_per_token: float, tokens_per_sec: float, num_devices: int, peak: float | None) -> float | None:
    """Fraction of the cluster's peak achieved: ``flops_per_token * tokens_per_sec / (num_devices * peak)``.

    ``tokens_per_sec`` is the throughput of the whole job (all devices together) and
    ``flops_per_token`` counts forward and backward (about 6 x parameters plus
    attention). ``None`` when the peak is unknown.
    """
    if peak is None or peak <= 0 or num_devices <= 0:
        return None
    return flops_per_token * tokens_per_sec / (num_devices * peak)
