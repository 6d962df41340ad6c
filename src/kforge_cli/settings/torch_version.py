"""The installed torch's (major, minor), read without importing torch (settings stay torch-free)."""

from __future__ import annotations

import importlib.metadata
import re
import sys


def parse_version(text: str) -> tuple[int, int] | None:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; None when it does not start with two numbers."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def torch_version() -> tuple[int, int] | None:
    """The running torch's version when it is imported already, else the installed one's; None if unknown."""
    loaded = sys.modules.get("torch")
    text = getattr(loaded, "__version__", None)
    if not isinstance(text, str):
        try:
            text = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            return None
    return parse_version(text)
