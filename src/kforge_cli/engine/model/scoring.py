"""Log-likelihood scoring: how likely a model finds a continuation after a context (fp32 math)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def continuation_logliks(model: nn.Module, context: list[int], continuations: list[list[int]]) -> list[float]:
    """Sum of ``log p(continuation tokens | context, earlier continuation tokens)`` for each continuation.

    Each continuation is scored in its own forward (one sequence, no padding to get
    wrong). A sequence longer than the model's ``max_seq_len`` loses context tokens from
    the left; the continuation itself must fit.
    """
    limit = int(model.cfg.max_seq_len)  # type: ignore[union-attr]
    device = next(model.parameters()).device
    out = []
    for cont in continuations:
        if not cont:
            raise ValueError("an empty continuation has no likelihood to score")
        if len(cont) >= limit:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit max_seq_len={limit} with context")
        seq = (context + cont)[-(limit + 1) :]
        tokens = torch.tensor([seq[:-1]], device=device)
        logprobs = model(tokens)[0].float().log_softmax(-1)  # [T, V]
        targets = torch.tensor(seq[1:], device=device)
        picked = logprobs.gather(1, targets[:, None])[:, 0]
        out.append(float(picked[-len(cont) :].double().sum()))
    return out
