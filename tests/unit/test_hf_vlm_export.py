"""A joint-decoder VLM exports as LLaVA (``LlavaForConditionalGeneration``) with the same logits.

Trained a few steps (every weight moved, norms included), exported, and loaded by
transformers: the text positions' fp32 logits, with an image, equal kforge's within 1e-5
of the largest, for the in-tree ViT (written as SigLIP), a Hugging Face SigLIP tower and a
CLIP tower, with the two-layer MLP adapter and the linear one. What LLaVA cannot hold
(MoT, cross-attention, average pooling) is refused with the field named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kforge_cli import load_model
from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.interop.hf_export import export_hf
from kforge_cli.settings import JobSettings
from tests.helpers.tiny_run import tiny_run
from tests.unit.test_vlm_hf_encoder import save_tower
from tests.unit.test_vlm_model import vlm_settings

transformers = pytest.importorskip("transformers")
REL_TOL = 1e-5
JOINT = ["--vlm.arch=joint_decoder", "--checkpoint.keep_last_n=0", "--optimizer.lr=1e-2"]


def train_vlm_and_save(run_dir: Path, s: JobSettings, steps: int = 2) -> Path:
    run = tiny_run(run_dir, s)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        ids = torch.randint(0, 257, (2, 13), generator=gen)
        pixels = torch.rand(2, 1, 3, 16, 16, generator=gen)
        logits = run.model(ids[:, :-1], pixel_values=pixels)
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.state.step = step
    return run.manager.save(steps, blocking=True)


def max_rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


def compare(step: Path, hf_dir: Path) -> tuple[str, float]:
    """(class transformers loaded, max relative logit difference on the text positions, with an image)."""
    g = torch.Generator().manual_seed(5)
    ids, pixels = torch.randint(0, 257, (2, 12), generator=g), torch.rand(2, 3, 16, 16, generator=g)
    config = json.loads((hf_dir / "config.json").read_text())
    prep = json.loads((hf_dir / "preprocessor_config.json").read_text())
    n, image = config["image_seq_length"], config["image_token_id"]
    hf_ids = torch.cat([torch.full((2, n), image), ids], dim=1)  # the image's tokens first, as kforge orders them
    mean, std = (torch.tensor(prep[k]).view(1, -1, 1, 1) for k in ("image_mean", "image_std"))
    with torch.no_grad():
        ours = load_model(step)(ids, pixel_values=pixels.unsqueeze(1))
        hf = transformers.AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        theirs = hf(input_ids=hf_ids, pixel_values=(pixels - mean) / std).logits[:, n:]
        text_only = load_model(step)(ids)
    assert max_rel_diff(ours, text_only) > 1e-3  # the image changes the logits: the comparison sees it
    return type(hf).__name__, max_rel_diff(ours, theirs)


CASES = {
    "vit-mlp": [],
    "vit-linear": ["--adapter.type=linear", "--model.tie_embeddings=true"],
    "siglip-mlp": ["hf:siglip"],
    "clip-mlp": ["hf:clip", "--model.qk_norm=true"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_joint_decoder_vlm_exports_as_llava_with_the_same_logits(tmp_path: Path, case: str) -> None:
    extra = list(CASES[case])
    if extra and extra[0].startswith("hf:"):
        family = extra.pop(0)[3:]
        save_tower(tmp_path / family, family)
        extra = [*extra, "--vision_encoder.type=hf", f"--vision_encoder.path={tmp_path / family}"]
    s = vlm_settings(*JOINT, *extra)
    step = train_vlm_and_save(tmp_path / "run", s)
    result = export_hf(step, tmp_path / "hf")
    assert result.hf_class == "LlavaForConditionalGeneration"
    cls, rel = compare(step, tmp_path / "hf")
    print(f"export-hf VLM {case}: {cls}, fp32 max rel logit diff {rel:.3e}")
    assert cls == "LlavaForConditionalGeneration" and rel <= REL_TOL


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--vlm.arch=mot"], "vlm.arch = 'mot'"),
        (["--vlm.arch=cross_attention", "--vlm.cross_attention_every=1"], "vlm.arch = 'cross_attention'"),
        ([*JOINT, "--adapter.type=avgpool"], "adapter.type = 'avgpool'"),
    ],
)
def test_what_llava_cannot_hold_is_refused_with_the_field_named(tmp_path: Path, extra: list[str], field: str) -> None:
    s = vlm_settings("--checkpoint.keep_last_n=0", *extra)
    step = train_vlm_and_save(tmp_path / "run", s, steps=1)
    with pytest.raises(CheckpointError, match="LlavaForConditionalGeneration") as info:
        export_hf(step, tmp_path / "hf")
    assert field in str(info.value)
    assert not (tmp_path / "hf").exists()
