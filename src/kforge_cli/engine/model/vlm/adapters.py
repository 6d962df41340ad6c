"""Adapters (connectors): vision features ``[N, tokens, vision_dim]`` -> ``[N, tokens', model_dim]``.

- ``linear``: one projection (LLaVA-1 style).
- ``mlp_2layer``: Linear -> GELU -> Linear (LLaVA-1.5 style); hidden size ``adapter.hidden_dim``
  or the model dim.
- ``avgpool``: average-pool each ``pool x pool`` patch neighbourhood, then project: ``pool**2``
  times fewer tokens per frame, which is what makes long video clips fit a sequence.

Each adapter reports ``tokens_out(tokens_in)`` so the sequence budget and the data
layout follow from the modules actually built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kforge_cli.settings.vlm import AdapterSettings

ADAPTER_INIT_STD = 0.02


def _init_linear(linear: nn.Linear) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=ADAPTER_INIT_STD)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class LinearAdapter(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim)

    def tokens_out(self, tokens_in: int) -> int:
        return tokens_in

    def init_weights(self) -> None:
        _init_linear(self.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class MLPAdapter(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def tokens_out(self, tokens_in: int) -> int:
        return tokens_in

    def init_weights(self) -> None:
        _init_linear(self.fc1)
        _init_linear(self.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class AvgPoolAdapter(nn.Module):
    """Pools the square patch grid by ``pool`` per side, then projects to the model dim."""

    def __init__(self, in_dim: int, out_dim: int, pool: int) -> None:
        super().__init__()
        self.pool = pool
        self.proj = nn.Linear(in_dim, out_dim)

    def tokens_out(self, tokens_in: int) -> int:
        side = math.isqrt(tokens_in)
        if side * side != tokens_in or side % self.pool:
            raise ValueError(f"avgpool needs a square patch grid divisible by pool {self.pool}, got {tokens_in} tokens")
        return (side // self.pool) ** 2

    def init_weights(self) -> None:
        _init_linear(self.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        side = math.isqrt(t)
        grid = x.transpose(1, 2).reshape(n, d, side, side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)  # [N, t / pool**2, d], row-major
        return self.proj(pooled)


def build_adapter(cfg: AdapterSettings, in_dim: int, out_dim: int) -> nn.Module:
    """The adapter named by ``adapter.type`` from vision features of ``in_dim`` to ``out_dim``."""
    if cfg.type == "linear":
        return LinearAdapter(in_dim, out_dim)
    if cfg.type == "mlp_2layer":
        return MLPAdapter(in_dim, out_dim, cfg.hidden_dim or out_dim)
    if cfg.type == "avgpool":
        return AvgPoolAdapter(in_dim, out_dim, cfg.pool)
    raise ValueError(f"unknown adapter type {cfg.type!r}")
