"""VLM models: ViT/adapters shapes and values, the three architectures, frame masking, MoT routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model.vlm import (
    AvgPoolAdapter,
    VisionLanguageModel,
    VisionTransformer,
    build_routes,
    build_vlm,
)
from kforge_cli.settings import JobSettings, load_settings
from kforge_cli.settings.vlm import VisionEncoderSettings
from tests.helpers import tiny

# A tiny VLM: 16 px images, 8 px patches -> 4 tokens per frame; 2 text layers of dim 32.
VLM_TINY = [
    *tiny.model(32, 2, 4, 2, max_seq_len=128),
    "--train.seq_len=64",
    *tiny.CPU_FP32,
    "--vision_encoder.image_size=16",
    "--vision_encoder.patch_size=8",
    "--vision_encoder.dim=32",
    "--vision_encoder.n_layers=1",
    "--vision_encoder.n_heads=4",
    "--vlm.max_text_len=48",
    *tiny.ONE_THREAD,
]


def vlm_settings(*extra: str) -> JobSettings:
    """vlm-mot-debug shrunk to unit-test size, with overrides."""
    return load_settings(profile="vlm-mot-debug", overrides=[*VLM_TINY, *extra], use_env=False).settings


def inputs(frames: int = 1, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 257, (batch, 12), generator=g), torch.rand(batch, frames, 3, 16, 16, generator=g)


def test_vit_patches_are_row_major_and_tokens_per_frame_is_reported() -> None:
    cfg = VisionEncoderSettings(image_size=16, patch_size=8, dim=32, n_layers=1, n_heads=4)
    torch.manual_seed(0)
    vit = VisionTransformer(cfg)
    assert (vit.tokens_per_frame, vit.grid, vit.out_dim) == (4, 2, 32)
    pixels = torch.rand(3, 3, 16, 16)
    patches = vit.patchify(pixels)
    assert patches.shape == (3, 4, 3 * 64)
    # patch 1 = row 0, column 1: pixels [:, 0:8, 8:16], flattened channel-major
    assert torch.equal(patches[:, 1], pixels[:, :, 0:8, 8:16].reshape(3, -1))
    assert vit(pixels).shape == (3, 4, 32)
    with pytest.raises(ValueError, match="do not fit the encoder"):
        vit(torch.rand(1, 3, 32, 32))


def test_avgpool_adapter_averages_each_neighbourhood_and_reduces_tokens() -> None:
    adapter = AvgPoolAdapter(in_dim=2, out_dim=2, pool=2)
    with torch.no_grad():
        adapter.proj.weight.copy_(torch.eye(2))
        adapter.proj.bias.zero_()
    grid = torch.arange(16 * 2, dtype=torch.float32).view(1, 16, 2)  # a 4x4 grid of 2-d features
    out = adapter(grid)
    assert adapter.tokens_out(16) == 4 and out.shape == (1, 4, 2)
    top_left = grid[0].view(4, 4, 2)[0:2, 0:2].reshape(4, 2).mean(0)
    bottom_right = grid[0].view(4, 4, 2)[2:4, 2:4].reshape(4, 2).mean(0)
    assert torch.equal(out[0, 0], top_left) and torch.equal(out[0, 3], bottom_right)
    s = vlm_settings(
        "--vlm.arch=joint_decoder", "--adapter.type=avgpool", "--adapter.pool=2", "--vision_encoder.image_size=32"
    )
    assert build_vlm(s).tokens_per_frame == 4  # 16 patches pooled 2x2


@pytest.mark.parametrize("arch", ["joint_decoder", "cross_attention", "mot"])
def test_every_arch_gives_text_logits_and_ignores_padded_frames(arch: str) -> None:
    torch.manual_seed(0)
    model = build_vlm(vlm_settings(f"--vlm.arch={arch}", "--vlm.cross_attention_every=1"))
    if arch == "cross_attention":  # make the (zero-initialised) cross-attention matter
        for block in model.layers.values():
            torch.nn.init.normal_(block.cross_attention.wo.weight, std=0.1)  # type: ignore[union-attr]
    ids, pixels = inputs(frames=3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    logits = model(ids, pixel_values=pixels, frame_mask=mask)
    assert logits.shape == (2, 12, 320)
    changed = pixels.clone()
    changed[0, 2] = torch.rand(3, 16, 16)  # only padded frames change
    changed[1, 1:] = 0.0
    assert torch.allclose(model(ids, pixel_values=changed, frame_mask=mask), logits, atol=1e-6)
    real_change = pixels.clone()
    real_change[0, 0] = torch.rand(3, 16, 16)
    assert (model(ids, pixel_values=real_change, frame_mask=mask) - logits)[0].abs().max() > 1e-4


def test_cross_attention_model_starts_as_the_text_model() -> None:
    torch.manual_seed(0)
    model = build_vlm(vlm_settings("--vlm.arch=cross_attention", "--vlm.cross_attention_every=1"))
    ids, pixels = inputs()
    assert torch.equal(model(ids, pixel_values=pixels), model(ids))
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.cross_attention.wq.weight" in names and "layers.1.cross_attention_norm.weight" in names


def _copy_text(dst: torch.nn.Module, src: VisionLanguageModel, rename: dict[str, str] | None = None) -> None:
    """Copy every text parameter of ``src`` into ``dst`` (dense names), renaming MoT experts when asked."""
    theirs = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            key = name
            for a, b in (rename or {}).items():
                key = key.replace(a, b)
            p.copy_(theirs[key])


def test_joint_decoder_on_text_alone_is_the_text_transformer() -> None:
    s = vlm_settings("--vlm.arch=joint_decoder")
    torch.manual_seed(0)
    vlm = build_vlm(s)
    dense = Transformer(s.model)
    _copy_text(dense, vlm)
    ids, _ = inputs()
    assert torch.equal(vlm(ids), dense(ids))


@pytest.mark.parametrize("extra", [[], ["--model.qk_norm=true"]], ids=["plain", "qk_norm"])
def test_mot_with_identical_experts_equals_the_joint_decoder_and_routes_by_modality(extra: list[str]) -> None:
    mot = build_vlm(vlm_settings("--vlm.arch=mot", *extra))
    torch.manual_seed(1)
    joint = build_vlm(vlm_settings("--vlm.arch=joint_decoder", *extra))
    with torch.no_grad():
        for name, p in mot.named_parameters():
            dense = name.replace(".experts.text.", ".").replace(".experts.image.", ".")
            p.copy_(dict(joint.named_parameters())[dense])
    ids, pixels = inputs(frames=2)
    mask = torch.tensor([[True, False], [True, True]])
    expected = joint(ids, pixel_values=pixels, frame_mask=mask)
    assert (mot(ids, pixel_values=pixels, frame_mask=mask) - expected).abs().max() < 1e-5
    # Text-only input never touches the image experts; with images it does.
    with torch.no_grad():
        for name, p in mot.named_parameters():
            if ".experts.image." in name:
                p.add_(0.5)
    assert torch.equal(mot(ids), joint(ids))
    assert (mot(ids, pixel_values=pixels, frame_mask=mask) - expected).abs().max() > 1e-3


def test_build_routes_partitions_tokens_by_modality_id() -> None:
    ids = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 2]])
    routes = dict(build_routes(ids, ["text", "image", "video"]))
    assert routes["text"].tolist() == [2, 3, 5, 6]  # type: ignore[union-attr]
    assert routes["image"].tolist() == [0, 1, 4]  # type: ignore[union-attr]
    assert routes["video"].tolist() == [7]  # type: ignore[union-attr]
    assert build_routes(torch.zeros(2, 3, dtype=torch.long), ["text", "image"]) == [("text", None)]


def test_mot_parameter_names_nest_the_dense_block_names() -> None:
    model = build_vlm(vlm_settings("--vlm.arch=mot"))
    names = {n for n, _ in model.named_parameters()}
    dense = {n for n, _ in Transformer(vlm_settings().model).named_parameters()}
    for name in dense:
        if name.startswith("layers."):
            i, rest = name.split(".", 2)[1:]
            assert {f"layers.{i}.experts.{m}.{rest}" for m in ("text", "image")} <= names
        else:
            assert name in names
    assert any(n.startswith("vision.layers.0.") for n in names) and any(n.startswith("adapter.") for n in names)
    assert len(model.vision_blocks()) == 1


def test_mot_needs_its_modalities() -> None:
    from kforge_cli.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="must include 'image'"):
        build_vlm(vlm_settings("--vlm.arch=mot", '--vlm.modalities=["text", "audio"]'))


def test_joint_loss_path_equals_logits_path() -> None:
    torch.manual_seed(0)
    model = build_vlm(vlm_settings("--vlm.arch=mot"))
    ids, pixels = inputs()
    labels = torch.randint(0, 257, ids.shape)
    labels[:, -3:] = -100

    def loss_fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")

    logits = model(ids, pixel_values=pixels)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    assert torch.allclose(model(ids, pixel_values=pixels, labels=labels, loss_fn=loss_fn), ref, rtol=1e-6)


def test_activation_checkpointing_keeps_the_vlm_loss_and_gradients() -> None:
    from kforge_cli.engine.parallel import build_parallel_model
    from kforge_cli.engine.runtime import init_runtime

    results = []
    for ac in ("none", "full"):
        s = vlm_settings("--vlm.arch=mot", f"--train.activation_checkpointing={ac}")
        model, _ = build_parallel_model(s, init_runtime(s))
        ids, pixels = inputs(frames=2)
        loss = model(ids, pixel_values=pixels, frame_mask=torch.tensor([[True, False], [True, True]])).square().mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))  # type: ignore[union-attr]
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b and grads_a.keys() == grads_b.keys()
    assert all(torch.allclose(grads_a[n], grads_b[n], atol=1e-7) for n in grads_a)


def test_tensor_parallel_limits_are_validation_errors() -> None:
    from kforge_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="tensor parallelism is not supported for vlm.arch = 'mot'"):
        vlm_settings("--vlm.arch=mot", "--distributed.tp=2")
    with pytest.raises(ConfigError, match="distributed.sequence_parallel: must be false for a VLM"):
        vlm_settings("--vlm.arch=joint_decoder", "--distributed.tp=2")
    vlm_settings("--vlm.arch=joint_decoder", "--distributed.tp=2", "--distributed.sequence_parallel=false")


def test_pipeline_parallel_vlm_is_refused_with_a_clear_message() -> None:
    from kforge_cli.settings.rules import world_size_issues

    s = vlm_settings("--distributed.pp=2", "--train.grad_accum_steps=2")
    messages = [str(i) for i in world_size_issues(s, 2)]
    assert "distributed.pp: pipeline parallelism is not supported for VLM models" in messages
