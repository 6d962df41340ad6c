"""Peak dense FLOP/s per device and compute dtype (hardware facts, no torch).

The vendor's *dense* tensor-core number (the datasheet's "with sparsity" figure halved).
Used by MFU (engine.observe.mfu) and by the planner's cost model (engine.plan), which
must not import the observe package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_T = 1e12

# TFLOP/s, dense. Keys are matched as whole tokens of the upper-cased device name,
# most specific (longest) first, so "GH200" is not read as "H200" and "H100 PCIE"
# wins over "H100".
_H100_SXM = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}
_NVL = {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "GH200": _H100_SXM,
    "H200 NVL": _NVL,
    "H200": _H100_SXM,
    "H100 NVL": _NVL,
    "H100 PCIE": {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.2},
    "H100": _H100_SXM,
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.05, "fp16": 181.05, "fp8": 362.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "tf32": 60.0, "fp32": 30.3},
    "V100 PCIE": {"fp16": 112.0, "fp32": 14.0},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
}

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}

_KEY_PATTERNS = [
    (key, re.compile(rf"(?<![A-Z0-9]){re.escape(key)}(?![A-Z0-9])"))
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True)
]


def _normalise_dtype(dtype: str) -> str | None:
    return _DTYPE_ALIASES.get(dtype.lower().removeprefix("torch."))


def match_device(device_name: str, table: Mapping[str, object]) -> str | None:
    """The key of ``table`` that names ``device_name``: whole upper-case tokens, the longest key first
    ("GH200" is not read as "H200"; "H100 PCIE" wins over "H100")."""
    name = device_name.upper()
    for key in sorted(table, key=len, reverse=True):
        if re.search(rf"(?<![A-Z0-9]){re.escape(key.upper())}(?![A-Z0-9])", name):
            return key
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device named like ``torch.cuda.get_device_name()``.

    ``None`` when the device or the dtype on that device is unknown.
    """
    name = device_name.upper()
    dtype_key = _normalise_dtype(dtype)
    if dtype_key is None:
        return None
    for key, pattern in _KEY_PATTERNS:
        if pattern.search(name):
            tflops = PEAK_TFLOPS[key].get(dtype_key)
            return None if tflops is None else tflops * _T
    return None
