"""`kforge generate --image`: a VLM continues a prompt about an image; the image file is untrusted input.

Greedy decoding with the image in the KV cache's prefill equals decoding by recomputation
token for token (joint decoder and MoT; a cross-attention model decodes without the
cache), the image changes what is generated, and transformers' LLaVA on the checkpoint's
export generates the same tokens. Files that are not small raster images exit 2 with
the file named, before any decoding.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kforge_cli.engine.inference.sampling import generate_text
from kforge_cli.engine.interop.open_checkpoint import open_for_inference
from kforge_cli.engine.model.generation import Sampling, generate_tokens
from kforge_cli.engine.train import run_training
from tests.unit.test_vlm_model import vlm_settings

RUN = [
    "--train.max_steps=3",
    "--train.batch_size=2",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--metrics.progress_bar=off",
    "--checkpoint.interval=0",
    "--vlm.cross_attention_every=1",
    "--optimizer.lr=1e-2",
]
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module", params=["joint_decoder", "mot", "cross_attention"])
def run_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"gen_{request.param}") / "run"
    s = vlm_settings(f"--vlm.arch={request.param}", *RUN, f"--train.run_dir={out}")
    assert run_training(s).status == "completed"
    return out


def png(path: Path, seed: int = 0, size: int = 24) -> Path:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)
    return path


def test_image_prefill_in_the_cache_equals_recomputation(run_dir: Path, tmp_path: Path) -> None:
    from kforge_cli.engine.data.vlm.media import read_image_file

    loaded = open_for_inference(run_dir)
    image = torch.from_numpy(read_image_file(png(tmp_path / "a.png"), 16, 3)).unsqueeze(0)
    ids = loaded.tokenizer.encode("a picture of")
    runs = [
        list(generate_tokens(loaded.model, ids, max_new_tokens=12, pixel_values=image, use_cache=cache))
        for cache in (True, False)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 12
    with torch.no_grad():  # the image is seen: the next-token distribution moves with it
        with_image = loaded.model(torch.tensor([ids]), pixel_values=image)[0, -1]
        other = torch.from_numpy(read_image_file(png(tmp_path / "b.png", seed=9), 16, 3)).unsqueeze(0)
        with_other = loaded.model(torch.tensor([ids]), pixel_values=other)[0, -1]
    assert (with_image - with_other).abs().max() > 1e-4


def test_generate_with_an_image_equals_llava_on_the_export(run_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from kforge_cli.engine.data.vlm.media import read_image_file
    from kforge_cli.engine.interop.hf_export import export_hf

    loaded = open_for_inference(run_dir)
    if loaded.model.arch != "joint_decoder":  # type: ignore[union-attr]
        pytest.skip("only the joint decoder has a transformers counterpart (LLaVA)")
    image = torch.from_numpy(read_image_file(png(tmp_path / "a.png"), 16, 3))
    prompt = loaded.tokenizer.encode("a picture of")
    ours = list(generate_tokens(loaded.model, prompt, max_new_tokens=10, pixel_values=image.unsqueeze(0)))
    (done,) = generate_text(loaded, ["a picture of"], sampling=GREEDY, max_new_tokens=10, image=image)
    assert done.new_tokens == len(ours) or done.finish_reason != "length"
    out = export_hf(loaded.path, tmp_path / "hf").out_dir
    config = json.loads((out / "config.json").read_text())
    n, image_id = config["image_seq_length"], config["image_token_id"]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf.generate(
            input_ids=torch.tensor([[image_id] * n + prompt]),
            pixel_values=((image - 0.5) / 0.5).unsqueeze(0),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
        )[0, n + len(prompt) :].tolist()
    print(f"generate --image (joint decoder): kforge {ours}, LLaVA on the export {got}")
    assert got == ours


def _huge_png(path: Path) -> Path:
    """A PNG whose header claims 20000 x 20000 pixels (with no real pixel data behind it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    return path


def test_cli_generate_with_an_image(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kforge_cli.cli.app import main

    image = png(tmp_path / "cat.png")
    args = ["generate", str(run_dir), "-p", "a picture of", "--image", str(image), "--temperature", "0"]
    with pytest.raises(SystemExit) as done:
        main([*args, "--max-new-tokens", "4", "--json"])
    assert done.value.code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["new_tokens"] == 4 or record["finish_reason"] == "eos"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.png", "No such file"),
        (lambda p: p, "is not a regular file"),
        (lambda p: (p / "notes.png").write_text("not an image") and p / "notes.png", "is not an image kforge reads"),
        (_huge_png, "at most 67,108,864 pixels"),
    ],
    ids=["missing", "directory", "text", "bomb"],
)
def test_bad_image_files_exit_2_naming_the_file(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, message: str
) -> None:
    from kforge_cli.cli.app import main

    target = tmp_path / "huge.png" if make is _huge_png else tmp_path
    path = make(target)  # type: ignore[operator]
    with pytest.raises(SystemExit) as done:
        main(["generate", str(run_dir), "-p", "x", "--image", str(path)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


def test_image_on_a_text_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kforge_cli.cli.app import main
    from tests.unit.test_inspect_ckpt import train_and_save

    saved = train_and_save(tmp_path / "run", [], steps=1)
    with pytest.raises(SystemExit) as done:
        main(
            ["generate", str(saved.steps[1]), "-p", "x", "--image", str(png(tmp_path / "a.png")), "--tokenizer", "byte"]
        )
    assert done.value.code == 2
    assert "needs a vision-language checkpoint" in capsys.readouterr().err
