"""kforge's dtype names (the settings' "fp32" / "bf16" / "fp16") and their torch dtypes, in one table."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16" (a KeyError for dtypes kforge does not train in)."""
    return _NAMES[dtype]


def torch_dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as Hugging Face's config.json spells it."""
    return str(dtype).removeprefix("torch.")
