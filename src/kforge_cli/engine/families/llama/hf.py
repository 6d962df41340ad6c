"""The Llama family's Hugging Face mapping (filled in by the interop part of issue 43)."""

from __future__ import annotations

from kforge_cli.engine.families.base import HFMapping

HF: HFMapping | None = None
