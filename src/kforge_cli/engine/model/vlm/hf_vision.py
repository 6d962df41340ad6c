"""A local Hugging Face SigLIP or CLIP vision tower as the VLM's encoder (never downloaded).

The module is built from the directory's ``config.json`` (so it can be built on the
meta device like every kforge model) and :meth:`HFVisionEncoder.init_weights` copies the
pretrained tensors from the directory's safetensors into the parameters with in-place
``copy_``: the sharded initialiser replays exactly that, so FSDP ranks end with their
shards of the pretrained weights. Parameter names are the HF module's under ``model.``
(``vision.model.encoder.layers.3.self_attn.q_proj.weight``).

CLIP's class token is dropped and SigLIP's pooling head is not built: the VLM consumes
one token per patch. Pixels arrive in ``[0, 1]`` and are normalised with the directory's
``preprocessor_config.json`` mean/std (0.5/0.5 when absent, SigLIP's convention).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from kforge_cli.common.files import read_text_capped
from kforge_cli.common.hf_numbers import check_hf_numbers
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.vlm import VisionEncoderSettings

_SUPPORTED = {"siglip": "siglip", "siglip_vision_model": "siglip", "clip": "clip", "clip_vision_model": "clip"}


def _require_transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise InvalidInputError(
            "vision_encoder.type = 'hf' needs the `transformers` package: pip install transformers "
            "(or use vision_encoder.type = 'vit')"
        ) from None
    return transformers


MAX_CONFIG_BYTES = 64 << 20  # a Hugging Face config.json / preprocessor_config.json is KBs


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_text_capped(path, MAX_CONFIG_BYTES, "config"))  # a FIFO or device is refused
    except (OSError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInputError(f"{path} does not hold a JSON object")
    return data


def _vision_config(root: Path) -> tuple[str, dict[str, Any]]:
    """(family, vision config dict) of a SigLIP/CLIP directory (full model or vision tower)."""
    cfg = _read_json(root / "config.json")
    family = _SUPPORTED.get(str(cfg.get("model_type")))
    if family is None:
        raise InvalidInputError(
            f"{root}/config.json has model_type {cfg.get('model_type')!r}; vision_encoder.type = 'hf' supports "
            f"{', '.join(sorted(_SUPPORTED))}"
        )
    vision = cfg.get("vision_config", cfg) if cfg.get("model_type") in ("siglip", "clip") else cfg
    if not isinstance(vision, dict):
        raise InvalidInputError(f"{root}/config.json: vision_config is not a JSON object")
    check_hf_numbers(vision, root / "config.json")  # the tower is built from these numbers
    return family, dict(vision)


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        return [root / n for n in names]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise InvalidInputError(f"{root} has no model.safetensors (or index): save the model with save_pretrained")


def _copy_into(target: torch.Tensor, src: torch.Tensor) -> None:
    """``target.copy_(src)``; a sharded (DTensor) target gets its own shard of ``src``."""
    if isinstance(target, DTensor):
        full = src.to(device=target.device, dtype=target.dtype)
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(src)  # on a meta shadow the sharded initialiser replays this on the real tensor


class HFVisionEncoder(nn.Module):
    """Wraps ``SiglipVisionModel`` / ``CLIPVisionModel`` built from a local directory."""

    def __init__(self, cfg: VisionEncoderSettings) -> None:
        super().__init__()
        if not cfg.path:
            raise InvalidInputError("vision_encoder.type = 'hf' needs vision_encoder.path (a local model directory)")
        root = Path(cfg.path).expanduser()
        if not (root / "config.json").is_file():
            raise InvalidInputError(
                f"vision_encoder.path {root} is not a Hugging Face model directory (no config.json)"
            )
        self.root = root.resolve()
        transformers = _require_transformers()
        self.family, vision = _vision_config(self.root)
        image_size, patch_size = int(vision["image_size"]), int(vision["patch_size"])
        if (image_size, patch_size) != (cfg.image_size, cfg.patch_size):
            raise InvalidInputError(
                f"{self.root} is a {image_size}px / patch {patch_size} model but vision_encoder has image_size "
                f"{cfg.image_size}, patch_size {cfg.patch_size}: set --vision_encoder.image_size={image_size} "
                f"--vision_encoder.patch_size={patch_size}"
            )
        if int(vision.get("num_channels", 3)) != cfg.channels:
            raise InvalidInputError(f"{self.root} takes {vision.get('num_channels', 3)} channels, not {cfg.channels}")
        vision = {k: v for k, v in vision.items() if k not in ("model_type", "architectures", "transformers_version")}
        if self.family == "siglip":
            config = transformers.SiglipVisionConfig(**{**vision, "vision_use_head": False})
            self.model = transformers.SiglipVisionModel(config)
        else:
            config = transformers.CLIPVisionConfig(**vision)
            self.model = transformers.CLIPVisionModel(config)
        self.image_size, self.patch_size, self.channels = image_size, patch_size, cfg.channels
        self.grid = image_size // patch_size
        self.tokens_per_frame = self.grid**2
        self.out_dim = int(config.hidden_size)
        pre = self.root / "preprocessor_config.json"
        prep = _read_json(pre) if pre.is_file() else {}
        self.mean = [float(x) for x in prep.get("image_mean", [0.5] * cfg.channels)]
        self.std = [float(x) for x in prep.get("image_std", [0.5] * cfg.channels)]

    def _inner(self) -> nn.Module:
        return getattr(self.model, "vision_model", self.model)  # transformers < 5 nests the tower

    def blocks(self) -> list[nn.Module]:
        return list(self._inner().encoder.layers)  # type: ignore[union-attr, arg-type]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Copy the pretrained tensors in (every parameter and persistent buffer must be found)."""
        from safetensors import safe_open

        wanted = dict(self.model.named_parameters())
        persistent = self.model.state_dict(keep_vars=True)
        wanted.update({k: v for k, v in persistent.items() if k not in wanted})
        found: set[str] = set()
        for file in _weight_files(self.root):
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                for name, target in wanted.items():
                    for key in (name, f"vision_model.{name}", name.removeprefix("vision_model.")):
                        if key in keys and name not in found:
                            _copy_into(target, f.get_tensor(key))
                            found.add(name)
        missing = sorted(set(wanted) - found)
        if missing:
            raise InvalidInputError(f"{self.root} lacks weights for {', '.join(missing[:5])}")
        for name, buf in self.model.named_buffers():
            if name.endswith("position_ids") and name not in persistent:
                buf.copy_(torch.arange(buf.shape[-1], device=buf.device).expand_as(buf))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [0, 1] ``[N, C, H, W]`` -> patch features ``[N, tokens_per_frame, out_dim]``."""
        mean = torch.tensor(self.mean, device=pixels.device, dtype=pixels.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=pixels.device, dtype=pixels.dtype).view(1, -1, 1, 1)
        hidden = self.model(pixel_values=(pixels - mean) / std).last_hidden_state
        return hidden[:, 1:] if self.family == "clip" else hidden
