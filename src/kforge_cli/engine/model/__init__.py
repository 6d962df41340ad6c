"""engine.model: the Llama-style Transformer, its initialisation, and parameter/FLOP counts."""

from kforge_cli.engine.model.flops import count_params, flops_per_token, non_embedding_params
from kforge_cli.engine.model.transformer import Transformer, TransformerBlock

__all__ = ["Transformer", "TransformerBlock", "count_params", "flops_per_token", "non_embedding_params"]
