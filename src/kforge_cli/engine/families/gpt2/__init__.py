"""The GPT-2 family (``model.family = "gpt2"``): the worked example of docs/extending.md."""

from kforge_cli.engine.families.gpt2.family import FAMILY, GPT2Family
from kforge_cli.engine.families.gpt2.model import GPT2

__all__ = ["FAMILY", "GPT2", "GPT2Family"]
