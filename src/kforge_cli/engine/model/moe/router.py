"""Top-k token-choice router, scored in fp32 (under autocast too: the logits are computed with it off).

The router decides *which* experts a token goes to from ``score + expert_bias``
(aux-loss-free balancing moves only the choice), and *how much* each chosen expert
counts from the unbiased score (so the bias never enters the gradient). Optional
group-limited routing (DeepSeek-V3) first keeps the ``topk_groups`` best groups of
experts per token, a group scored by the sum of its two best member scores (its best
score when groups have one expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.settings.moe import MoESettings


@dataclass
class Routing:
    """The router's decision for ``N`` tokens.

    ``experts`` ``[N, k]`` chosen expert ids; ``weights`` ``[N, k]`` fp32 gate weights;
    ``probs`` ``[N, E]`` fp32 per-token score distribution (for the aux loss);
    ``logits`` ``[N, E]`` fp32 router logits (for the z-loss).
    """

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


class TopKRouter(nn.Module):
    """``gate``: a bias-free ``[num_experts, dim]`` linear map; routing maths in fp32."""

    def __init__(self, dim: int, cfg: MoESettings) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.num_experts, bias=False)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None) -> Routing:
        """``x`` ``[N, D]`` -> :class:`Routing`; ``expert_bias`` ``[E]`` shifts selection only."""
        cfg = self.cfg
        with torch.autocast(x.device.type, enabled=False):  # F.linear has an autocast rule: keep fp32
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = torch.sigmoid(logits) if cfg.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias.float()
        if cfg.n_groups > 1:
            choice = _limit_to_groups(choice, cfg.n_groups, cfg.topk_groups)
        experts = torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, experts)
        if cfg.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.route_scale
        probs = scores if cfg.score_func == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(experts=experts, weights=weights, probs=probs, logits=logits)


def _limit_to_groups(choice: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``choice`` with every expert outside each token's ``topk_groups`` best groups set to -inf."""
    n, e = choice.shape
    grouped = choice.view(n, n_groups, e // n_groups)
    best = min(2, e // n_groups)
    group_score = grouped.topk(best, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)
