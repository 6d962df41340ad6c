"""A kforge vision-language model as ``LlavaForConditionalGeneration`` (``export-hf`` of a VLM run).

LLaVA holds kforge's ``joint_decoder`` VLM exactly (the round-trip test compares logits):

- **vision tower**: the in-tree ViT *is* a SigLIP vision transformer (a patch projection
  with bias, learned positions, pre-norm blocks with LayerNorm eps 1e-6, tanh-GELU MLP of
  4 x dim, a final LayerNorm): ``patch_embed`` becomes the patch convolution, ``qkv`` is
  split into ``q_proj``/``k_proj``/``v_proj``, ``norm`` is ``post_layernorm``; its pixel
  normalisation ((x - 0.5) / 0.5) goes to ``preprocessor_config.json``. A Hugging Face
  SigLIP or CLIP tower (``vision_encoder.type = "hf"``) is written as itself.
- **features**: the last layer, after the final norm for SigLIP/ViT
  (``tie_last_hidden_states``) and before it for CLIP, whose class token is dropped
  (``vision_feature_select_strategy = "default"``), as kforge does.
- **adapter**: ``mlp_2layer`` is LLaVA's projector (``gelu_pytorch_tanh``); ``linear``
  is its first layer with an identity activation and an identity second layer.
- **decoder**: the text model (Llama, or Qwen3 with QK-norm) under ``language_model``;
  the visual tokens of each image come first, where ``image_token_id`` marks them in
  ``input_ids``: ``[image_token_id] * image_seq_length + text ids``.

What LLaVA has no place for is refused, naming the field: ``vlm.arch = "mot"``
(per-modality weights inside every block) and ``"cross_attention"`` (gated cross-attention
layers), ``adapter.type = "avgpool"`` (LLaVA projects every patch), an ``mlp_2layer``
hidden size other than the model dim, and an MoE decoder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.engine.checkpoint.reader import CheckpointView
from kforge_cli.engine.families.base import HFExport
from kforge_cli.engine.interop.hf_tokenizer import ExportedTokenizer
from kforge_cli.settings import JobSettings
from kforge_cli.settings.training import ModelSettings

HF_CLASS = "LlavaForConditionalGeneration"
PREPROCESSOR_FILE = "preprocessor_config.json"
_PROJECTOR = {"fc1": "linear_1", "fc2": "linear_2", "proj": "linear_1"}
_VIT_LAYER = re.compile(r"^vision\.layers\.(\d+)\.(.+)$")
_VIT_BLOCK = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.proj": "self_attn.out_proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def vlm_export_problems(settings: JobSettings) -> list[str]:
    """What ``LlavaForConditionalGeneration`` cannot hold of this VLM (empty: exportable)."""
    from kforge_cli.engine.interop.hf_family import export_problems

    vlm, adapter, model = settings.vlm, settings.adapter, settings.model
    problems = []
    if vlm is not None and vlm.arch != "joint_decoder":
        why = {
            "mot": "per-modality norms, projections and MLPs in every block; no transformers architecture has them",
            "cross_attention": "gated cross-attention layers between the decoder blocks; LLaVA has none",
        }[vlm.arch]
        problems.append(f"vlm.arch = {vlm.arch!r} ({why})")
    if adapter is not None and adapter.type == "avgpool":
        problems.append("adapter.type = 'avgpool' (LLaVA's projector takes every patch; it has no pooling)")
    if adapter is not None and adapter.type == "mlp_2layer" and adapter.hidden_dim not in (None, model.dim):
        problems.append(
            f"adapter.hidden_dim = {adapter.hidden_dim} (LLaVA's projector is model.dim = {model.dim} wide)"
        )
    if model.moe is not None:
        problems.append("model.moe is set (LLaVA is exported with a dense decoder only)")
    fields = model.model_dump()
    return problems + export_problems(fields)


@dataclass(frozen=True)
class VLMPlan:
    """``export_hf``'s plan for a joint-decoder VLM (see the module docstring)."""

    settings: JobSettings
    text: HFExport  # the text family's exporter (the decoder under ``language_model``)
    fields: dict[str, object]
    family: str  # "vit" (written as SigLIP), "siglip" or "clip"
    vision_config: dict[str, object]
    mean: list[float]
    std: list[float]

    hf_class = HF_CLASS

    @property
    def text_settings(self) -> ModelSettings:
        return self.settings.model

    @property
    def image_token_id(self) -> int:
        return int(self.settings.model.vocab_size) - 1

    @property
    def image_seq_length(self) -> int:
        enc = self.settings.vision_encoder
        assert enc is not None
        return enc.tokens_per_frame

    def name(self, key: str) -> str | None:
        if key.startswith("vision."):
            return self._vision_name(key)
        if key.startswith("adapter."):  # fc1/fc2 (mlp_2layer) or proj (linear), .weight/.bias
            module, kind = key.removeprefix("adapter.").split(".", 1)
            return f"multi_modal_projector.{_PROJECTOR[module]}.{kind}"
        text = self.text.name(key)
        return None if text is None else "language_model." + text

    def _vision_name(self, key: str) -> str:
        if self.family != "vit":  # a Hugging Face tower: its own names (transformers < 5 nested them)
            return "vision_tower." + key.removeprefix("vision.model.").removeprefix("vision_model.")
        top = {
            "vision.patch_embed.weight": "embeddings.patch_embedding.weight",
            "vision.patch_embed.bias": "embeddings.patch_embedding.bias",
            "vision.pos_embed": "embeddings.position_embedding.weight",
            "vision.norm.weight": "post_layernorm.weight",
            "vision.norm.bias": "post_layernorm.bias",
        }
        if key in top:
            return "vision_tower." + top[key]
        m = _VIT_LAYER.match(key)
        if not m:
            raise CheckpointError(f"vision parameter {key!r} has no SigLIP counterpart")
        module, kind = m.group(2).rsplit(".", 1)
        prefix = f"vision_tower.encoder.layers.{m.group(1)}."
        if module == "attn.qkv":
            return prefix + "self_attn.{qkv}_proj." + kind
        return prefix + _VIT_BLOCK[module] + "." + kind

    def tensors(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        name = self.name(key)
        if name is None:
            return {}
        if key.startswith("vision."):
            if key == "vision.patch_embed.weight" and self.family == "vit":
                enc = self.settings.vision_encoder
                assert enc is not None
                return {name: t.reshape(t.shape[0], enc.channels, enc.patch_size, enc.patch_size).contiguous()}
            if "{qkv}" in name:
                q, k, v = t.chunk(3, dim=0)
                return {name.format(qkv=n): part.contiguous() for n, part in zip("qkv", (q, k, v), strict=True)}
            return {name: t.contiguous()}
        if key.startswith("adapter.proj."):  # linear adapter: linear_1, then identity activation and linear_2
            dim = int(self.settings.model.dim)
            second = torch.eye(dim, dtype=t.dtype) if key.endswith("weight") else torch.zeros(dim, dtype=t.dtype)
            return {name: t.contiguous(), name.replace("linear_1", "linear_2"): second}
        if key.startswith("adapter."):
            return {name: t.contiguous()}
        return {"language_model." + k: v for k, v in self.text.tensors(key, t).items()}

    def config(self, torch_dtype: str) -> dict[str, object]:
        text = self.text.config(torch_dtype)
        text.pop("architectures", None)
        adapter = self.settings.adapter
        linear = adapter is not None and adapter.type == "linear"
        return {
            "architectures": [HF_CLASS],
            "model_type": "llava",
            "text_config": text,
            "vision_config": self.vision_config,
            "image_token_id": self.image_token_id,
            "image_token_index": self.image_token_id,
            "image_seq_length": self.image_seq_length,
            "projector_hidden_act": "linear" if linear else "gelu_pytorch_tanh",
            "multimodal_projector_bias": True,
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "default" if self.family == "clip" else "full",
            "tie_word_embeddings": bool(text.get("tie_word_embeddings")),
            "torch_dtype": torch_dtype,
        }

    def write_extras(self, out: Path, tokenizer: ExportedTokenizer | None) -> None:
        enc = self.settings.vision_encoder
        assert enc is not None
        processor = {
            "image_processor_type": "CLIPImageProcessor" if self.family == "clip" else "SiglipImageProcessor",
            "do_resize": True,
            "size": {"height": enc.image_size, "width": enc.image_size},
            "resample": 2,  # bilinear, as kforge's image loader resizes
            "do_center_crop": False,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": self.mean,
            "image_std": self.std,
            "do_convert_rgb": enc.channels == 3,
        }
        (out / PREPROCESSOR_FILE).write_text(json.dumps(processor, indent=2) + "\n")


def _vision_side(settings: JobSettings) -> tuple[str, dict[str, object], list[float], list[float]]:
    """(family, LLaVA's vision_config, pixel mean, pixel std) of the VLM's encoder."""
    enc = settings.vision_encoder
    assert enc is not None
    if enc.type == "vit":
        config = {
            "model_type": "siglip_vision_model",
            "hidden_size": enc.dim,
            "intermediate_size": 4 * enc.dim,
            "num_hidden_layers": enc.n_layers,
            "num_attention_heads": enc.n_heads,
            "num_channels": enc.channels,
            "image_size": enc.image_size,
            "patch_size": enc.patch_size,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "attention_dropout": 0.0,
            "vision_use_head": False,
            "tie_last_hidden_states": True,  # hidden_states[-1] is after post_layernorm, as kforge's ViT output
        }
        return "vit", config, [0.5] * enc.channels, [0.5] * enc.channels
    from kforge_cli.engine.model.vlm.hf_vision import _read_json, _vision_config
    from kforge_cli.errors import InvalidInputError

    if not enc.path:
        raise CheckpointError("vision_encoder.type = 'hf' without vision_encoder.path: its config.json is needed")
    root = Path(enc.path).expanduser()
    try:
        family, vision = _vision_config(root)
        pre = root / PREPROCESSOR_FILE
        prep = _read_json(pre) if pre.is_file() else {}
    except InvalidInputError as exc:
        raise CheckpointError(f"the VLM's vision_encoder.path is needed for its config: {exc}") from None
    config = {k: v for k, v in vision.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    config["model_type"] = f"{family}_vision_model"
    if family == "siglip":
        config.update(vision_use_head=False, tie_last_hidden_states=True)
    mean = [float(x) for x in prep.get("image_mean", [0.5] * enc.channels)]
    std = [float(x) for x in prep.get("image_std", [0.5] * enc.channels)]
    return family, config, mean, std


def vlm_export_plan(view: CheckpointView) -> VLMPlan:
    """The LLaVA plan of a VLM checkpoint, or a CheckpointError naming what LLaVA cannot hold."""
    from kforge_cli.engine.interop.load_model import vlm_settings_of

    settings = vlm_settings_of(view)
    problems = vlm_export_problems(settings)
    if problems:
        raise CheckpointError(
            f"cannot export {view.path} as {HF_CLASS} (the transformers architecture closest to kforge's VLM): "
            + "; ".join(problems)
        )
    fields = settings.model.model_dump()
    family, vision, mean, std = _vision_side(settings)
    from kforge_cli.engine.interop.hf_family import family_of_fields

    text_family = family_of_fields(fields)
    assert text_family.hf is not None  # vlm_export_problems refused a family without a mapping
    exporter = text_family.hf.exporter(fields, settings.model)
    return VLMPlan(settings, exporter, fields, family, vision, mean, std)
