"""Once-per-optimizer-step MoE bookkeeping: bias update, load metrics, aux-loss collection.

Aux-loss-free balancing (DeepSeek-V3): after each optimizer step every expert's
selection bias moves by ``bias_update_rate`` towards balance, ``+rate`` for experts
that got fewer tokens than the mean and ``-rate`` for those that got more (then
re-centred to mean zero). The token counts are summed over all micro-batches of
the step and all-reduced over ``group`` (every rank that routes tokens), so every
rank applies the same update and holds the same bias.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from kforge_cli.engine.model.moe.layer import MoEFeedForward


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoEFeedForward]]:
    """``(block key, layer)`` for every MoE feed-forward this module (or pipeline stage) holds."""
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            parts = name.split(".")
            key = parts[parts.index("layers") + 1] if "layers" in parts else name
            yield key, module


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the latest forward's weighted aux/z-losses over all MoE layers (None if none)."""
    losses = [layer.aux_loss for _, layer in moe_layers(model) if layer.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


@torch.no_grad()
def finish_moe_step(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """All-reduce this step's expert counts, update the biases, reset the counters; return metrics.

    Call exactly once per optimizer step on every rank of ``group`` (None = the default
    group when distributed is initialised, else no reduction). Metrics per MoE layer
    ``L``: ``moe/L/load_max_over_mean`` (max / mean tokens per expert), ``moe/L/dropped``
    (token-expert pairs over capacity), ``moe/L/aux_loss`` (mean weighted aux loss per
    forward on this rank), plus ``moe/load_max_over_mean`` averaged over layers. They are
    device scalars and nothing here reads the device: the step's metrics are read on the
    host only on logging steps.
    """
    layers = list(moe_layers(model))
    if not layers:
        return {}
    stats = torch.stack([torch.cat([lay.step_tokens, lay.step_dropped.view(1)]) for _, lay in layers])  # [L, E + 1]
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)  # int64: exact
    stats = stats.double()
    tokens, dropped = stats[:, :-1], stats[:, -1]
    mean = tokens.mean(dim=1)
    busy = mean > 0
    ratios = torch.where(busy, tokens.amax(dim=1) / torch.where(busy, mean, 1.0), 1.0)  # no tokens: balanced
    metrics: dict[str, torch.Tensor] = {}
    for i, (key, layer) in enumerate(layers):
        metrics[f"moe/{key}/load_max_over_mean"] = ratios[i]
        metrics[f"moe/{key}/dropped"] = dropped[i]
        if layer.moe.aux_loss_weight > 0 or layer.moe.z_loss_weight > 0:
            metrics[f"moe/{key}/aux_loss"] = layer.step_aux / layer.step_forwards.clamp(min=1)
        rate = layer.moe.bias_update_rate
        if rate > 0:  # sign(mean - tokens) is 0 everywhere when no tokens came: the bias stays
            delta = rate * torch.sign(mean[i] - tokens[i])
            layer.expert_bias.copy_((layer.expert_bias.double() + delta - delta.mean()).to(layer.expert_bias.dtype))
        layer.reset_step_stats()
    metrics["moe/load_max_over_mean"] = ratios.mean()
    return metrics
