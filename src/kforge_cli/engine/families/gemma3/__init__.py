"""The Gemma 3 family (text): interleaved sliding-window and global attention (``model.family = "gemma3"``)."""

from kforge_cli.engine.families.gemma3.family import FAMILY

__all__ = ["FAMILY"]
