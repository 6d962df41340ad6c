"""engine.model.vlm: vision encoders, adapters, the joint / cross-attention / MoT vision-language
models, and freeze specs (layer 1, like the text model).

    from kforge_cli.engine.model.vlm import build_vlm
    model = build_vlm(settings)             # settings.vlm and settings.vision_encoder set
    logits = model(input_ids, pixel_values=pixels, frame_mask=frame_mask)   # text positions only
"""

from kforge_cli.engine.model.vlm.adapters import AvgPoolAdapter, LinearAdapter, MLPAdapter, build_adapter
from kforge_cli.engine.model.vlm.cross_attention import CrossAttention, CrossAttentionDecoderLayer
from kforge_cli.engine.model.vlm.freeze import (
    ALIASES,
    check_specs,
    freeze_mismatch,
    freeze_record,
    frozen_names,
    frozen_specs_at,
    matches,
)
from kforge_cli.engine.model.vlm.mot import MoTBlock, build_routes
from kforge_cli.engine.model.vlm.vision import VisionTransformer, build_vision_encoder
from kforge_cli.engine.model.vlm.vlm_model import VisionLanguageModel, build_vlm, visual_modality

__all__ = [
    "ALIASES",
    "AvgPoolAdapter",
    "CrossAttention",
    "CrossAttentionDecoderLayer",
    "LinearAdapter",
    "MLPAdapter",
    "MoTBlock",
    "VisionLanguageModel",
    "VisionTransformer",
    "build_adapter",
    "build_routes",
    "build_vision_encoder",
    "build_vlm",
    "check_specs",
    "freeze_mismatch",
    "freeze_record",
    "frozen_names",
    "frozen_specs_at",
    "matches",
    "visual_modality",
]
