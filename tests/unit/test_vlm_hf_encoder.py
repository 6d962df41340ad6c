"""A local Hugging Face SigLIP / CLIP directory as the VLM's vision encoder (loaded from a path, never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kforge_cli.engine.model.vlm import build_vlm
from kforge_cli.errors import InvalidInputError
from tests.unit.test_vlm_model import vlm_settings

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 16,
    "patch_size": 8,
}


def save_tower(path: Path, family: str) -> torch.nn.Module:
    torch.manual_seed(3)
    if family == "siglip":
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SMALL))
    else:
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SMALL))
        path.mkdir(parents=True)
        (path / "preprocessor_config.json").write_text(
            json.dumps({"image_mean": [0.48, 0.45, 0.40], "image_std": [0.26, 0.26, 0.27]})
        )
    model.eval().save_pretrained(str(path))
    return model


@pytest.mark.parametrize("family", ["siglip", "clip"])
def test_hf_tower_features_equal_transformers(tmp_path: Path, family: str) -> None:
    hf = save_tower(tmp_path / family, family)
    s = vlm_settings(
        "--vlm.arch=joint_decoder", "--vision_encoder.type=hf", f"--vision_encoder.path={tmp_path / family}"
    )
    torch.manual_seed(0)
    model = build_vlm(s)
    assert model.vision.tokens_per_frame == 4 and model.tokens_per_frame == 4
    pixels = torch.rand(2, 3, 16, 16)
    mean, std = (
        (0.5, 0.5) if family == "siglip" else (torch.tensor([0.48, 0.45, 0.40]), torch.tensor([0.26, 0.26, 0.27]))
    )
    if family == "clip":
        mean, std = mean.view(1, 3, 1, 1), std.view(1, 3, 1, 1)
    with torch.no_grad():
        expected = hf(pixel_values=(pixels - mean) / std).last_hidden_state
        expected = expected[:, 1:] if family == "clip" else expected  # CLIP's class token is dropped
        got = model.vision(pixels)
    assert (got - expected).abs().max() < 1e-5
    assert len(model.vision_blocks()) == 2
    ids = torch.randint(0, 257, (2, 8))
    assert model(ids, pixel_values=pixels.unsqueeze(1)).shape == (2, 8, 320)


def test_hf_tower_of_another_size_says_which_settings_fit(tmp_path: Path) -> None:
    save_tower(tmp_path / "siglip", "siglip")
    s = vlm_settings(
        "--vision_encoder.type=hf", f"--vision_encoder.path={tmp_path / 'siglip'}", "--vision_encoder.image_size=32"
    )
    with pytest.raises(InvalidInputError, match="--vision_encoder.image_size=16 --vision_encoder.patch_size=8"):
        build_vlm(s)
    missing = vlm_settings("--vision_encoder.type=hf", f"--vision_encoder.path={tmp_path / 'none'}")
    with pytest.raises(InvalidInputError, match="not a Hugging Face model directory"):
        build_vlm(missing)
