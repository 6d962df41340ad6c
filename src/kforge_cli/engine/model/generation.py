"""Autoregressive decoding: greedy or sampled (temperature, top-k, top-p), with or without a KV cache.

Tokens in, tokens out: the tokenizer and stop strings belong to the caller. With the
cache the prompt runs once (prefill) and every later step feeds one token; without it
every step recomputes the whole sequence. Both paths compute the same logits, which is
what the tests hold them to (greedy decoding must agree token for token).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kforge_cli.engine.model.kv_cache import KVCache, supports_kv_cache


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature=0`` is greedy (argmax); ``top_k=0``/``top_p=1`` keep all."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """The token chosen from ``[vocab]`` logits (fp32 math, so bf16 models sample the same way)."""
    logits = logits.float()
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass before it is below top_p (the most likely token is always kept)
        drop = (probs.cumsum(-1) - probs) >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def max_positions(model: nn.Module) -> int:
    """The model's ``max_seq_len`` (RoPE tables end there)."""
    return int(model.cfg.max_seq_len)  # type: ignore[union-attr]


def visual_positions(model: nn.Module, pixel_values: torch.Tensor | None) -> int:
    """Sequence positions the images take before the text (a joint-decoder or MoT VLM; 0 otherwise)."""
    if pixel_values is None or getattr(model, "arch", "cross_attention") == "cross_attention":
        return 0
    frames = 1 if pixel_values.dim() == 4 else int(pixel_values.shape[1])
    return frames * int(model.tokens_per_frame)  # type: ignore[arg-type]


@torch.no_grad()
def generate_tokens(
    model: nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(temperature=0.0),
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    pixel_values: torch.Tensor | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids after `prompt` (stops after yielding `eos_id`).

    The sequence never outgrows ``max_seq_len``: the last token may be chosen at position
    ``max_seq_len`` but is not fed back. ``use_cache`` falls back to recomputation for a
    model without cache-aware attention. `pixel_values` (a vision-language model: one
    image ``[1, C, H, W]`` or clip ``[1, F, C, H, W]``) goes before the prompt; its tokens
    count against ``max_seq_len`` (joint decoder, MoT), and a cross-attention model,
    which reads them in every layer, decodes without the cache.
    """
    limit = max_positions(model)
    visual = visual_positions(model, pixel_values)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if visual + len(prompt) > limit:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens"
            + (f" after {visual} image tokens" if visual else "")
            + f", more than the model's max_seq_len={limit}"
        )
    param = next(model.parameters())
    device = param.device
    budget = min(max_new_tokens, limit - visual - len(prompt) + 1)
    cross = pixel_values is not None and getattr(model, "arch", None) == "cross_attention"
    # sized to what this call can feed (image, prompt and fed-back tokens), not max_seq_len: a
    # 131k-position model must not take its full-length cache for a short prompt
    size = min(limit, visual + len(prompt) + budget)
    cache = KVCache(size) if use_cache and not cross and supports_kv_cache(model) else None
    images = None if pixel_values is None else pixel_values.to(device=device, dtype=param.dtype)
    ids = list(prompt)
    feed = torch.tensor([ids], device=device)
    for produced in range(budget):
        extra = {} if images is None else {"pixel_values": images}
        if cache is not None:
            logits = model(feed, kv_cache=cache, **(extra if produced == 0 else {}))
        else:
            logits = model(torch.tensor([ids], device=device), **extra)
        token = next_token(logits[0, -1], sampling, generator)
        yield token
        if token == eos_id or produced + 1 == budget:
            return
        ids.append(token)
        feed = torch.tensor([[token]], device=device)
