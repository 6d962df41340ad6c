"""The Transformer MLP: SwiGLU (gated) or GELU, no biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.settings.training import ModelSettings


class FeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` for SwiGLU, ``w2(gelu_tanh(w1 x))`` for GELU.

    The names follow Llama (``w1`` gate/up, ``w3`` up, ``w2`` down) because they are
    the checkpoint contract; GELU simply has no ``w3``.
    """

    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        hidden = cfg.resolved_ffn_hidden_dim
        self.activation = cfg.activation
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3: nn.Linear | None = nn.Linear(cfg.dim, hidden, bias=False) if cfg.activation == "swiglu" else None

    def init_weights(self, std: float, out_std: float) -> None:
        """Input projections ~ N(0, std); the residual output ``w2`` ~ N(0, out_std)."""
        nn.init.normal_(self.w1.weight, mean=0.0, std=std)
        if self.w3 is not None:
            nn.init.normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
