"""VLM data: synthetic set, batches, resumable order, manifests/directories, clips, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kforge_cli.engine.data.vlm import BadSampleError, SyntheticCaptions, build_vlm_data, load_clip, scan_directory
from kforge_cli.errors import ConfigError, InvalidInputError
from kforge_cli.settings import load_settings
from tests.unit.test_vlm_model import VLM_TINY, vlm_settings


def _take(loader: object, n: int) -> list[dict[str, torch.Tensor]]:
    it = iter(loader)  # type: ignore[call-overload]
    return [next(it) for _ in range(n)]


def test_synthetic_batches_have_fixed_shapes_and_captions_that_describe_the_image() -> None:
    bundle = build_vlm_data(vlm_settings("--train.batch_size=4"), dp_rank=0, dp_size=1)
    batch = _take(bundle.train, 1)[0]
    assert batch["input_ids"].shape == (4, 48) and batch["labels"].shape == (4, 48)
    assert batch["pixel_values"].shape == (4, 1, 3, 16, 16) and batch["pixel_values"].dtype == torch.float32
    assert batch["frame_mask"].tolist() == [[True]] * 4
    tok = bundle.tokenizer
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    n = int((labels != -100).sum())
    assert ids[0] == tok.eos_id and labels[n - 1] == tok.eos_id  # EOS + caption + EOS
    assert torch.equal(ids[1:n], labels[: n - 1]) and (labels[n:] == -100).all()
    caption = tok.decode(ids[1:n].tolist())
    assert caption.startswith("a ") and caption.endswith(".")
    # the same sample index always gives the same picture and caption
    src = SyntheticCaptions(8, 16, 3, seed=42)
    a, b = src.load(3), src.load(3)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    assert not np.array_equal(SyntheticCaptions(8, 16, 3, seed=43).load(3)[0], a[0])  # another data seed


def test_loader_state_resumes_exactly_and_ranks_split_the_global_batch() -> None:
    s = vlm_settings("--train.batch_size=4")
    first = build_vlm_data(s, dp_rank=0, dp_size=1)
    ref = _take(first.train, 5)
    again = build_vlm_data(s, dp_rank=0, dp_size=1)
    _take(again.train, 2)
    state = again.train.state_dict()
    resumed = build_vlm_data(s, dp_rank=0, dp_size=1)
    resumed.train.load_state_dict(json.loads(json.dumps(state)))
    for got, want in zip(_take(resumed.train, 3), ref[2:], strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)
    half = vlm_settings("--train.batch_size=2")
    r0, r1 = (_take(build_vlm_data(half, dp_rank=r, dp_size=2).train, 1)[0] for r in (0, 1))
    assert torch.equal(torch.cat([r0["pixel_values"], r1["pixel_values"]]), ref[0]["pixel_values"])


def test_synthetic_video_clips_are_padded_and_masked() -> None:
    s = vlm_settings("--train.seq_len=96", "--video.max_frames=4", "--train.batch_size=8")
    batch = _take(build_vlm_data(s, dp_rank=0, dp_size=1).train, 1)[0]
    assert batch["pixel_values"].shape == (8, 4, 3, 16, 16)
    counts = batch["frame_mask"].sum(1)
    assert counts.min() >= 2 and counts.max() <= 4 and counts.min() < 4  # some clips are shorter
    for row, n in enumerate(counts.tolist()):
        assert batch["frame_mask"][row, :n].all() and not batch["frame_mask"][row, n:].any()
        assert (batch["pixel_values"][row, n:] == 0).all()
    captions = [build_vlm_data(s, dp_rank=0, dp_size=1).tokenizer.decode(r.tolist()) for r in batch["input_ids"]]
    assert any(" moving " in c for c in captions)


def test_the_sequence_budget_is_checked_by_validation() -> None:
    with pytest.raises(ConfigError, match=r"4 frame\(s\) x 4 image tokens \+ vlm.max_text_len 48 = 64"):
        load_settings(
            profile="vlm-mot-debug", overrides=[*VLM_TINY, "--train.seq_len=63", "--video.max_frames=4"], use_env=False
        )
    vlm_settings("--video.max_frames=4")  # 4 x 4 + 48 = 64 fits exactly


def _png(path: Path, size: tuple[int, int], color: tuple[int, int, int]) -> Path:
    Image.new("RGB", size, color).save(path)
    return path


def _manifest(root: Path, records: list[dict[str, str]], name: str = "train.jsonl") -> Path:
    path = root / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_jsonl_manifest_of_images_of_any_size_is_resized(tmp_path: Path) -> None:
    _png(tmp_path / "red.png", (40, 24), (255, 0, 0))
    _png(tmp_path / "blue.jpg", (16, 16), (0, 0, 255))
    _manifest(tmp_path, [{"image": "red.png", "caption": "red"}, {"image": "blue.jpg", "caption": "blue"}])
    _manifest(tmp_path, [{"image": "blue.jpg", "caption": "blue"}], "val.jsonl")
    bundle = build_vlm_data(vlm_settings(f"--vlm.data_path={tmp_path}", "--train.batch_size=2"), dp_rank=0, dp_size=1)
    batch = _take(bundle.train, 1)[0]
    by_caption = {
        bundle.tokenizer.decode(r[1:].tolist()).strip(): p
        for r, p in zip(batch["input_ids"], batch["pixel_values"], strict=True)
    }
    assert torch.allclose(by_caption["red"][0, 0], torch.ones(16, 16)) and (by_caption["red"][0, 1:] == 0).all()
    assert (by_caption["blue"][0, 2] > 0.99).all()
    assert bundle.val is not None
    val = next(bundle.val.iter_batches(1, 2))
    assert val["pixel_values"].shape == (2, 1, 3, 16, 16)


def test_a_missing_image_is_an_error_naming_it_or_skipped_when_asked(tmp_path: Path) -> None:
    _png(tmp_path / "ok.png", (16, 16), (9, 9, 9))
    manifest = _manifest(
        tmp_path, [{"image": "ok.png", "caption": "fine"}, {"image": "gone.png", "caption": "x"}], "data.jsonl"
    )
    with pytest.raises(BadSampleError, match=r"image .*gone\.png \(from .*data\.jsonl:2\) does not exist"):
        build_vlm_data(vlm_settings(f"--vlm.data_path={manifest}"), dp_rank=0, dp_size=1)
    bundle = build_vlm_data(
        vlm_settings(f"--vlm.data_path={manifest}", "--vlm.skip_bad_samples=true"), dp_rank=0, dp_size=1
    )
    assert bundle.train.state_dict()["dataset_windows"] == [1]


def test_a_corrupt_image_is_an_error_naming_it_or_replaced_and_counted(tmp_path: Path) -> None:
    _png(tmp_path / "ok.png", (16, 16), (9, 9, 9))
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    manifest = _manifest(tmp_path, [{"image": "bad.png", "caption": "b"}, {"image": "ok.png", "caption": "o"}])
    strict = build_vlm_data(vlm_settings(f"--vlm.data_path={manifest}", "--train.batch_size=2"), dp_rank=0, dp_size=1)
    with pytest.raises(BadSampleError, match=r"image .*bad\.png is corrupt or not an image"):
        _take(strict.train, 1)
    lenient = build_vlm_data(
        vlm_settings(f"--vlm.data_path={manifest}", "--train.batch_size=2", "--vlm.skip_bad_samples=true"),
        dp_rank=0,
        dp_size=1,
    )
    batch = _take(lenient.train, 1)[0]
    assert lenient.skipped_samples == 1
    assert (batch["pixel_values"] - 9 / 255).abs().max() < 1e-6  # both rows are the readable image


def test_a_caption_longer_than_max_text_len_is_never_truncated(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", (16, 16), (1, 2, 3))
    _png(tmp_path / "b.png", (16, 16), (1, 2, 3))
    long = "x" * 60
    manifest = _manifest(tmp_path, [{"image": "a.png", "caption": long}, {"image": "b.png", "caption": "short"}])
    with pytest.raises(BadSampleError, match=r"caption of .*a\.png .* has 60 tokens but vlm.max_text_len = 48"):
        build_vlm_data(vlm_settings(f"--vlm.data_path={manifest}"), dp_rank=0, dp_size=1)
    ok = build_vlm_data(
        vlm_settings(f"--vlm.data_path={manifest}", "--vlm.skip_bad_samples=true"), dp_rank=0, dp_size=1
    )
    assert ok.train.state_dict()["dataset_windows"] == [1]


def test_clips_from_frame_directories_and_npy_arrays(tmp_path: Path) -> None:
    frames = tmp_path / "walk"
    frames.mkdir()
    for i in range(3):
        _png(frames / f"{i:03d}.png", (32, 32), (i * 100, 0, 0))
    (tmp_path / "walk.txt").write_text("a walk\n")
    arr = np.zeros((10, 8, 8, 3), dtype=np.uint8)
    arr[:, :, :, 1] = np.arange(10)[:, None, None] * 20
    np.save(tmp_path / "fade.npy", arr)
    (tmp_path / "fade.txt").write_text("a fade")
    records = scan_directory(tmp_path)
    assert [(r.kind, r.path.name, r.caption) for r in records] == [
        ("video", "fade.npy", "a fade"),
        ("video", "walk", "a walk"),
    ]
    clip = load_clip(frames, 16, 3, max_frames=4, stride=1)
    assert clip.shape == (3, 3, 16, 16) and abs(float(clip[2, 0].mean()) - 200 / 255) < 1e-6
    long = load_clip(tmp_path / "fade.npy", 16, 3, max_frames=4, stride=2)  # frames 0,2,4,6,8 -> 4 spread
    assert long.shape == (4, 3, 16, 16)
    assert [round(float(f[1].mean()) * 255) for f in long] == [0, 40, 120, 160]  # frames 0, 2, 6, 8
    s = vlm_settings(
        f"--vlm.data_path={tmp_path}", "--train.seq_len=96", "--video.max_frames=4", "--train.batch_size=2"
    )
    batch = _take(build_vlm_data(s, dp_rank=0, dp_size=1).train, 1)[0]
    assert sorted(batch["frame_mask"].sum(1).tolist()) == [3, 4]


def test_bad_paths_and_manifests_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        build_vlm_data(vlm_settings(f"--vlm.data_path={tmp_path / 'nope'}"), dp_rank=0, dp_size=1)
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"image": "a.png", "caption": "ok"}\n{not json}\n')
    with pytest.raises(InvalidInputError, match=r"m\.jsonl:2: not valid JSON"):
        build_vlm_data(vlm_settings(f"--vlm.data_path={bad}"), dp_rank=0, dp_size=1)
    _png(tmp_path / "lonely.png", (4, 4), (0, 0, 0))
    with pytest.raises(InvalidInputError, match=r"lonely\.png has no caption file lonely\.txt"):
        scan_directory(tmp_path)
