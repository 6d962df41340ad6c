"""Text generation from a loaded checkpoint: encode, decode token by token, stream, stop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kforge_cli.engine.interop.open_checkpoint import LoadedCheckpoint, check_tokenizer_fits
from kforge_cli.engine.model.generation import Sampling, generate_tokens, max_positions, visual_positions
from kforge_cli.errors import InvalidInputError


@dataclass
class Completion:
    """One prompt's result (the ``--json`` record)."""

    prompt: str
    completion: str
    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # "eos", "stop" (a stop string), "length" (max_new_tokens or max_seq_len)
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def check_prompts(loaded: LoadedCheckpoint, prompts: list[str], reserved: int = 0) -> list[list[int]]:
    """Token ids of every prompt, refusing empty ones and ones longer than the model's max_seq_len
    (less `reserved` positions: an image's tokens)."""
    check_tokenizer_fits(loaded)
    limit = max_positions(loaded.model) - reserved
    encoded = []
    for i, text in enumerate(prompts):
        ids = loaded.tokenizer.encode(text)
        if not ids:
            raise InvalidInputError(f"prompt {i + 1} is empty: give some text to continue")
        if len(ids) > limit:
            room = (
                f"the {limit} positions the model's max_seq_len={limit + reserved} leaves after the image's "
                f"{reserved} tokens"
                if reserved
                else f"the model's max_seq_len={limit}"
            )
            raise InvalidInputError(f"prompt {i + 1} is {len(ids)} tokens, longer than {room}: shorten it")
        encoded.append(ids)
    return encoded


def generate_text(
    loaded: LoadedCheckpoint,
    prompts: list[str],
    *,
    sampling: Sampling,
    max_new_tokens: int,
    seed: int | None = None,
    stop: list[str] | None = None,
    use_cache: bool = True,
    on_text: Callable[[int, str], None] | None = None,
    image: torch.Tensor | None = None,
) -> list[Completion]:
    """Continue every prompt; `on_text(index, piece)` receives the completion as it grows (streaming).

    One ``torch.Generator`` seeded with `seed` serves all prompts in order, so a seeded
    call is reproducible. A stop string ends the completion before it (it is not returned).
    `image` (``[C, H, W]`` in [0, 1], a vision-language checkpoint only) goes before every prompt.
    """
    pixels = None
    if image is not None:
        if not hasattr(loaded.model, "encode_visual"):
            raise InvalidInputError(f"--image needs a vision-language checkpoint; {loaded.path} holds a text model")
        pixels = image.unsqueeze(0)
    encoded = check_prompts(loaded, prompts, visual_positions(loaded.model, pixels))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tok, stops = loaded.tokenizer, [s for s in (stop or []) if s]
    # text that may still turn out to be the start of a stop string is held back from the stream
    holdback = max((len(s) for s in stops), default=1) - 1
    results = []
    for index, (text, ids) in enumerate(zip(prompts, encoded, strict=True)):
        start, new, reason = time.perf_counter(), [], "length"
        shown = [""]

        def emit(upto: str, index: int = index, shown: list[str] = shown) -> None:
            upto = upto.rstrip("\ufffd")  # an incomplete multi-byte character waits for its next token
            if on_text is not None and upto.startswith(shown[0]) and len(upto) > len(shown[0]):
                on_text(index, upto[len(shown[0]) :])
                shown[0] = upto

        final = ""
        for token in generate_tokens(
            loaded.model,
            ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_id=tok.eos_id,
            generator=generator,
            use_cache=use_cache,
            pixel_values=pixels,
        ):
            if token == tok.eos_id:
                reason = "eos"
                break
            new.append(token)
            final = tok.decode(new)
            cut = min((final.find(s) for s in stops if s in final), default=-1)
            if cut >= 0:
                final, reason = final[:cut], "stop"
                break
            emit(final[: len(final) - holdback])
        if on_text is not None:
            shown_text = shown[0]
            if final.startswith(shown_text) and len(final) > len(shown_text):
                on_text(index, final[len(shown_text) :])
        results.append(Completion(text, final, len(ids), len(new), reason, time.perf_counter() - start))
    return results
