"""`kforge export-hf` and `--checkpoint.init_from=HF_DIR` for real: kforge -> transformers -> kforge.

Needs the `transformers` test extra (skipped without it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kforge_cli import load_model
from tests.conftest import run_kforge

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")

# GQA (4 query heads, 2 kv heads) with a tied embedding / output head.
MODEL = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.max_seq_len=64",
    "--model.tie_embeddings=true",
]
TRAIN = [
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--eval.interval=0",
    "--scheduler.warmup_steps=1",
    "--metrics.progress_bar=off",
    "--train.num_threads=1",
    "--checkpoint.keep_last_n=0",
]
REL_TOL = 1e-5


def max_rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


def logits_pair(kforge_ckpt: Path, hf_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    toks = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return load_model(kforge_ckpt)(toks), hf(toks).logits


def test_trained_checkpoint_exports_to_transformers_with_the_same_logits(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = run_kforge("train", "--run-dir", str(run), *MODEL, *TRAIN, "--train.max_steps=3", "--checkpoint.interval=3")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "hf"
    r = run_kforge("export-hf", str(run), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported 20 tensors" in r.stdout and "(step 3) as float32" in r.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    ours, theirs = logits_pair(run / "checkpoints" / "step_3", out)
    rel = max_rel_diff(ours, theirs)
    print(f"kforge -> export-hf -> transformers: max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL
    again = run_kforge("export-hf", str(run), str(out))
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr
    missing = run_kforge("export-hf", str(tmp_path / "nope"), str(tmp_path / "x"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def _make_hf_llama(path: Path) -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))


def test_continued_pretraining_from_a_transformers_directory(tmp_path: Path) -> None:
    """HF dir -> kforge train (init_from, one step at a negligible LR) -> the checkpoint still gives HF's logits."""
    hf_dir = tmp_path / "hf"
    _make_hf_llama(hf_dir)
    run = tmp_path / "run"
    r = run_kforge(
        "train",
        "--run-dir",
        str(run),
        *MODEL,
        *TRAIN,
        "--model.ffn_hidden_dim=96",
        f"--checkpoint.init_from={hf_dir}",
        "--train.max_steps=1",
        "--checkpoint.interval=1",
        "--optimizer.lr=1e-9",
        "--optimizer.weight_decay=0",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    log = (run / "logs" / "rank_0.log").read_text()
    assert f"warm start: loaded 20 tensors from Hugging Face {hf_dir}" in log
    ours, theirs = logits_pair(run / "checkpoints" / "step_1", hf_dir)
    rel = max_rel_diff(ours, theirs)
    print(f"transformers -> init_from -> kforge (1 step at lr 1e-9): max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL


def test_init_from_an_hf_model_of_another_shape_is_refused_with_the_fitting_overrides(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    _make_hf_llama(hf_dir)
    r = run_kforge(
        "train", "--run-dir", str(tmp_path / "run"), *TRAIN, "--train.max_steps=1", f"--checkpoint.init_from={hf_dir}"
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "is a differently shaped model" in r.stderr and "dim: run has 128, hf has 32" in r.stderr
    assert "--model.dim=32" in r.stderr and "--model.ffn_hidden_dim=96" in r.stderr
    assert "Traceback" not in r.stderr
