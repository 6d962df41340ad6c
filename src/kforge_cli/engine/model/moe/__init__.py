"""engine.model.moe: Mixture-of-Experts feed-forward layers, router, grouped-GEMM experts, balancing."""

from kforge_cli.engine.model.moe.balancing import finish_moe_step, moe_aux_loss, moe_layers
from kforge_cli.engine.model.moe.experts import GroupedExperts, expert_loop
from kforge_cli.engine.model.moe.layer import MoEFeedForward
from kforge_cli.engine.model.moe.router import Routing, TopKRouter

__all__ = [
    "GroupedExperts",
    "MoEFeedForward",
    "Routing",
    "TopKRouter",
    "expert_loop",
    "finish_moe_step",
    "moe_aux_loss",
    "moe_layers",
]
