"""kforge: pre-train LLMs and VLMs with PyTorch's native distributed stack.

Importing this package is cheap (no torch). `load_model` is resolved lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kforge_cli.engine.interop.load_model import load_model

from kforge_cli.version import __version__

__all__ = ["__version__", "load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from kforge_cli.engine.interop.load_model import load_model

        return load_model
    raise AttributeError(f"module 'kforge_cli' has no attribute {name!r}")
