"""engine.model (layer 1): model building blocks (attention, masks, MLP, MoE layers, norms, the
pre-norm decoder block, KV cache, generation) and parameter/FLOP counts. Models are assembled by
the families (``engine/families``)."""

from kforge_cli.engine.model.block import TransformerBlock
from kforge_cli.engine.model.flops import count_params, flops_per_token, non_embedding_params

__all__ = ["TransformerBlock", "count_params", "flops_per_token", "non_embedding_params"]
