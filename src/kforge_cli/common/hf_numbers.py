"""Bounds on the numbers of a Hugging Face ``config.json``: one check for every class kforge imports.

A config's numbers decide shapes, divisions and loops (over layers, experts) before any weight
is read; a crafted one (``moe_layer_interval: 0``, ``num_hidden_layers: 1e12``) must be refused
here, naming the file and the key, not end in a ZeroDivisionError or MemoryError. Torch-free:
``engine.interop.hf_format.read_hf_config`` (text models) and the HF vision tower reader use it.
"""

from __future__ import annotations

import math
from pathlib import Path

from kforge_cli.errors import InvalidInputError

MAX_LAYERS = 10_000  # the deepest released models have ~100-200 blocks
MAX_SIZE = 1 << 31  # any width, vocabulary or context length kforge could build
# Every integer field a Hugging Face config of a class kforge imports (Llama, Qwen3, Qwen3-MoE,
# GLM-4-MoE, ERNIE-4.5-MoE, LLaVA's text/vision parts) uses in a shape, a division or a loop:
# field -> (least, most). A new family's fields go here too.
HF_INT_FIELDS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, MAX_SIZE),
    "intermediate_size": (1, MAX_SIZE),
    "num_attention_heads": (1, 1 << 16),
    "num_key_value_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16),
    "num_hidden_layers": (1, MAX_LAYERS),
    "vocab_size": (1, MAX_SIZE),
    "max_position_embeddings": (1, MAX_SIZE),
    "moe_intermediate_size": (1, MAX_SIZE),
    "num_experts": (1, 1 << 20),
    "n_routed_experts": (1, 1 << 20),
    "moe_num_experts": (1, 1 << 20),
    "num_experts_per_tok": (1, 1 << 20),
    "moe_k": (1, 1 << 20),
    "n_shared_experts": (0, 1 << 20),
    "moe_num_shared_experts": (0, 1 << 20),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "n_group": (1, 1 << 20),
    "topk_group": (1, 1 << 20),
    "decoder_sparse_step": (1, MAX_LAYERS),
    "moe_layer_interval": (1, MAX_LAYERS),
    "moe_layer_start_index": (0, MAX_LAYERS),
    "moe_layer_end_index": (-1, MAX_LAYERS),
    "image_size": (1, 1 << 16),
    "patch_size": (1, 1 << 16),
    "num_channels": (1, 64),
    "image_token_index": (0, MAX_SIZE),
}
HF_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "partial_rotary_factor", "moe_norm_min")
HF_NESTED = ("text_config", "vision_config", "rope_parameters", "rope_scaling")


def check_hf_numbers(
    config: dict[str, object], path: Path | str, where: str = "", error: type[InvalidInputError] = InvalidInputError
) -> None:
    """Refuse (`error`, exit 2) any field of ``HF_INT_FIELDS`` that is not an integer in its
    range, a ``HF_FLOAT_FIELDS`` one that is not a finite number, and ``mlp_only_layers`` that is not
    a short list of layer indices, here and in the nested configs; before any of them is used.

    A crafted config (``moe_layer_interval: 0``, ``num_hidden_layers: 1e12``) then never reaches a
    division or a loop over its layers.
    """
    for key, (least, most) in HF_INT_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        integral = isinstance(number, int) or (
            isinstance(number, float) and math.isfinite(number) and number.is_integer()
        )
        if number is None or not integral or not least <= int(number) <= most:
            raise error(
                f"{path}: {where}{key} = {_short(value)} is not an integer from {least} to {most}: "
                "not a model kforge can import (check the file)"
            )
    for key in HF_FLOAT_FIELDS:
        value = config.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        ):
            raise error(f"{path}: {where}{key} = {_short(value)} is not a finite number (check the file)")
    dense = config.get("mlp_only_layers")
    if dense is not None and (
        not isinstance(dense, list)
        or len(dense) > MAX_LAYERS
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS for i in dense)
    ):
        raise error(f"{path}: {where}mlp_only_layers must be a list of layer indices (check the file)")
    for key in HF_NESTED:
        nested = config.get(key)
        if isinstance(nested, dict):
            check_hf_numbers(nested, path, f"{where}{key}.", error)


def _short(value: object) -> str:
    text = (
        repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
    )
    return text if len(text) <= 40 else text[:37] + "..."
