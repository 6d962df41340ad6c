"""Optional sections for vision-language models (present only for VLM jobs)."""

from __future__ import annotations

from typing import Literal

from kforge_cli.settings.section import Section, field


class VisionEncoderSettings(Section):
    """The image encoder: the in-tree ViT or a local Hugging Face SigLIP/CLIP directory."""

    type: Literal["vit", "hf"] = field("vit", "In-tree ViT, or a local Hugging Face vision model.")
    path: str | None = field(None, "Local Hugging Face model directory (type = hf).")
    image_size: int = field(224, "Input image side in pixels.", gt=0)
    patch_size: int = field(16, "ViT patch side in pixels.", gt=0)
    channels: int = field(3, "Image channels.", gt=0)
    dim: int = field(384, "ViT hidden size.", gt=0)
    n_layers: int = field(6, "ViT blocks.", gt=0)
    n_heads: int = field(6, "ViT attention heads.", gt=0)

    @property
    def tokens_per_frame(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class AdapterSettings(Section):
    """The connector from vision features to the language model's hidden size."""

    type: Literal["linear", "mlp_2layer", "avgpool"] = field("mlp_2layer", "Adapter type.")
    pool: int = field(2, "avgpool: pool p x p patches into one token.", gt=0)
    hidden_dim: int | None = field(None, "mlp_2layer hidden size (None = the model dim).", gt=0)


class FreezeStage(Section):
    """Modules frozen from a given step on (until the next stage)."""

    start_step: int = field(..., "First step of this stage.", ge=0)
    freeze: list[str] = field(list, "Module aliases or name patterns frozen in this stage.")


class VLMSettings(Section):
    """How vision and text are combined."""

    arch: Literal["joint_decoder", "cross_attention", "mot"] = field(
        "joint_decoder", "joint_decoder, cross_attention or mot (Mixture-of-Transformers)."
    )
    cross_attention_every: int = field(4, "cross_attention: a cross-attention block every k layers.", gt=0)
    max_text_len: int = field(128, "Text tokens per sample.", gt=0)
    modalities: list[str] = field(lambda: ["text", "image"], "MoT modalities (one set of weights each).")
    data_path: str | None = field(None, "Image-text data: a directory or JSONL manifest (None = synthetic).")
    freeze: list[str] = field(list, "Module aliases or patterns frozen for the whole run.")
    freeze_schedule: list[FreezeStage] = field(list, "Freeze stages by step.")
    allow_freeze_mismatch: bool = field(False, "Allow resuming with a different freeze configuration.")
    mot_warm_start_from: str | None = field(
        None, "Dense text checkpoint to warm-start a fresh MoT run from (never on resume)."
    )
    skip_bad_samples: bool = field(False, "Skip (and count) unreadable images instead of failing.")


class VideoSettings(Section):
    """Video clips as sequences of frames."""

    max_frames: int = field(8, "Frames per clip (shorter clips are padded and masked).", gt=0)
    frame_stride: int = field(1, "Take every n-th frame of a clip.", gt=0)
