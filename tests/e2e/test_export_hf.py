"""`kforge export-hf` and `--checkpoint.init_from=HF_DIR` for real: kforge -> transformers -> kforge.

Needs the `transformers` test extra (skipped without it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kforge_cli import load_model
from tests.conftest import run_kforge
from tests.helpers import tiny

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")

# GQA (4 query heads, 2 kv heads) with a tied embedding / output head.
MODEL = [*tiny.model(32, 2, 4, 2, max_seq_len=64), "--model.tie_embeddings=true"]
TRAIN = [
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--eval.interval=0",
    "--scheduler.warmup_steps=1",
    "--metrics.progress_bar=off",
    *tiny.ONE_THREAD,
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
    assert "exported 20 tensors" in r.stdout and "(step 3) as float32 LlamaForCausalLM to" in r.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    ours, theirs = logits_pair(run / "checkpoints" / "step_3", out)
    rel = max_rel_diff(ours, theirs)
    print(f"kforge -> export-hf -> transformers: max rel logit diff {rel:.3e}")
    assert rel <= REL_TOL
    # The byte tokenizer (built-in corpus) is exported as one transformers loads: id = byte, EOS = 256.
    assert config["bos_token_id"] == config["eos_token_id"] == 256
    # no max_length: transformers warns on every generate(max_new_tokens=...) when both are set
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 256, "eos_token_id": 256}
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Hi é\n"
    assert tok(text)["input_ids"] == list(text.encode("utf-8")) and tok.eos_token_id == 256
    assert tok.decode([*text.encode("utf-8"), 256], skip_special_tokens=True) == text
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, (f.name, oct(f.stat().st_mode))
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


def _bpe_tokenizer(path: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # pyright: ignore[reportAttributeAccessIssue]
    tok.decoder = decoders.ByteLevel()  # pyright: ignore[reportAttributeAccessIssue]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def test_bpe_prepare_train_export_then_transformers_generates_until_eos(tmp_path: Path) -> None:
    """prepare-data with a tokenizer.json -> train -> export-hf -> AutoTokenizer + generate stop at EOS."""
    doc = "the cat sat on the mat."
    _bpe_tokenizer(tmp_path / "tok.json", [doc] * 50)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for _ in range(400)))
    r = run_kforge(
        "prepare-data",
        "docs.jsonl",
        "--tokenizer",
        "tok.json",
        "--out",
        "bpe",
        "--quiet",
        "--workers",
        "1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_kforge(
        "train",
        "--run-dir",
        "run",
        "--data.path=bpe",  # relative: config.toml stores it absolute
        "--model.dim=32",
        "--model.n_layers=2",
        "--model.n_heads=2",
        "--model.n_kv_heads=1",
        *TRAIN,
        "--train.batch_size=8",
        "--train.max_steps=60",
        "--checkpoint.interval=60",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import tomllib

    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())["data"]
    assert saved["path"] == str((tmp_path / "bpe").resolve())
    assert saved["tokenizer"] == str((tmp_path / "bpe" / "tokenizer.json").resolve())
    out = tmp_path / "hf"
    r = run_kforge("export-hf", str(tmp_path / "run"), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id == eos
    prompt = tok("the cat", return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=30, do_sample=False, pad_token_id=eos)
    new = ids[0, prompt["input_ids"].shape[1] :].tolist()
    assert eos in new and new.index(eos) == len(new) - 1, new  # stopped at the first EOS
    text = tok.decode(new, skip_special_tokens=True)
    assert text == " sat on the mat.", (text, r.stdout)
