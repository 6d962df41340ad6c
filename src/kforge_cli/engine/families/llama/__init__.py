"""The Llama family (``model.family = "llama"``, the default): model, plans, HF mapping."""

from kforge_cli.engine.families.llama.family import FAMILY, LlamaFamily
from kforge_cli.engine.families.llama.model import Transformer, TransformerBlock

__all__ = ["FAMILY", "LlamaFamily", "Transformer", "TransformerBlock"]
