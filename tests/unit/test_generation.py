"""Generation: KV-cache decoding equals full recomputation and transformers' generate; sampling is seeded.

One tiny checkpoint (weights scaled up by a large init_std so greedy choices are not
near-ties) serves every test: cached vs recomputed greedy tokens, a Hugging Face
export decoded by ``transformers.generate``, seeded top-k/top-p sampling, the VLM's
text-only path (MoT), and the prompt-length / stop-string behaviour of the text layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kforge_cli.engine.inference.sampling import generate_text
from kforge_cli.engine.interop.hf_export import export_hf
from kforge_cli.engine.interop.open_checkpoint import open_for_inference
from kforge_cli.engine.model.generation import Sampling, generate_tokens
from kforge_cli.engine.model.kv_cache import KVCache
from kforge_cli.errors import InvalidInputError
from tests.unit.test_inspect_ckpt import Saved, train_and_save

PROMPT = [5, 17, 3, 42, 8]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    torch.set_num_threads(1)
    return train_and_save(
        tmp_path_factory.mktemp("gen") / "run", ["--model.init_std=0.3", "--model.vocab_size=320"], steps=1
    )


def _greedy(model: torch.nn.Module, prompt: list[int], n: int, cache: bool) -> list[int]:
    return list(generate_tokens(model, prompt, max_new_tokens=n, use_cache=cache))


def test_cached_greedy_equals_recompute_and_the_logits_match(saved: Saved) -> None:
    loaded = open_for_inference(saved.steps[1])
    cached, full = _greedy(loaded.model, PROMPT, 27, True), _greedy(loaded.model, PROMPT, 27, False)
    assert cached == full and len(cached) == 27  # 5 + 27 = max_seq_len 32: the whole window
    assert len(set(cached)) > 3  # not a degenerate repeat that any bug would also produce
    # the decode steps' logits themselves agree with a full forward (fp32)
    seq = torch.tensor([PROMPT + cached])
    with torch.no_grad():
        reference = loaded.model(seq)
        cache = KVCache(32)
        pieces = [loaded.model(seq[:, :5], kv_cache=cache)]
        pieces += [loaded.model(seq[:, i : i + 1], kv_cache=cache) for i in range(5, 20)]
        pieces.append(loaded.model(seq[:, 20:26], kv_cache=cache))  # a multi-token chunk after the cache
    torch.testing.assert_close(torch.cat(pieces, 1), reference[:, :26], rtol=1e-5, atol=1e-5)
    # and the budget stops at max_seq_len: a 32-token prompt still yields exactly one token
    assert len(_greedy(loaded.model, list(range(32)), 10, True)) == 1


def test_greedy_equals_transformers_generate_on_the_export(saved: Saved, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_dir = export_hf(saved.steps[1], tmp_path / "hf").out_dir
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = _greedy(open_for_inference(saved.steps[1]).model, PROMPT, 20, True)
    assert out[0, len(PROMPT) :].tolist() == ours


def test_seeded_sampling_is_reproducible_and_seeds_differ(saved: Saved) -> None:
    model = open_for_inference(saved.steps[1]).model
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9)

    def draw(seed: int, cache: bool = True) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return list(
            generate_tokens(model, PROMPT, max_new_tokens=20, sampling=sampling, generator=gen, use_cache=cache)
        )

    assert draw(1) == draw(1) == draw(1, cache=False)
    assert draw(1) != draw(2)


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus() -> None:
    from kforge_cli.engine.model.generation import next_token

    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert {next_token(logits, Sampling(top_k=1), gen) for _ in range(20)} == {1}
    # p(1) ~ 0.50, p(2) ~ 0.45: top_p=0.6 keeps exactly {1, 2}
    assert {next_token(logits, Sampling(top_p=0.6), gen) for _ in range(200)} == {1, 2}


class _Letters:
    """A stub tokenizer: id i is the letter chr(65 + i % 26); no EOS within the vocabulary."""

    name, vocab_size, eos_id = "letters", 320, 10_000

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 65 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def test_prompt_longer_than_max_seq_len_is_refused_and_stop_strings_cut(saved: Saved) -> None:
    loaded = open_for_inference(saved.steps[1])  # no config.toml: the byte tokenizer
    assert loaded.tokenizer.name == "byte"
    with pytest.raises(InvalidInputError, match="33 tokens, longer than the model's max_seq_len=32"):
        generate_text(loaded, ["x" * 33], sampling=Sampling(temperature=0), max_new_tokens=4)
    loaded.tokenizer = _Letters()  # type: ignore[assignment]
    greedy = Sampling(temperature=0)
    (free,) = generate_text(loaded, ["FRAQI"], sampling=greedy, max_new_tokens=20)
    assert free.finish_reason == "length" and len(free.completion) == 20
    stop = free.completion[6:8]
    streamed: list[str] = []
    (cut,) = generate_text(
        loaded, ["FRAQI"], sampling=greedy, max_new_tokens=20, stop=[stop], on_text=lambda _, t: streamed.append(t)
    )
    assert cut.finish_reason == "stop" and cut.completion == free.completion[: free.completion.index(stop)]
    assert "".join(streamed) == cut.completion


def test_mot_vlm_text_only_decoding_uses_the_cache_correctly() -> None:
    from kforge_cli.engine.model.vlm import build_vlm
    from tests.unit.test_vlm_model import vlm_settings

    torch.manual_seed(0)
    model = build_vlm(vlm_settings("--model.init_std=0.3", "--model.vocab_size=64")).eval()
    assert model.arch == "mot"
    assert _greedy(model, PROMPT, 20, True) == _greedy(model, PROMPT, 20, False)


def test_cli_generate_json_and_a_too_long_prompt(saved: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kforge_cli.cli.app import main

    run_dir = saved.steps[1].parent.parent
    with pytest.raises(SystemExit) as done:
        main(["generate", str(run_dir), "-p", "ab", "-p", "c", "--temperature", "0", "--max-new-tokens", "5", "--json"])
    assert done.value.code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["ab", "c"] and records[0]["step"] == 1
    assert all(r["prompt_tokens"] == len(r["prompt"]) and r["new_tokens"] <= 5 for r in records)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(run_dir), "-p", "y" * 40, "--max-new-tokens", "2"])
    assert exit_info.value.code == 2
    assert "40 tokens, longer than the model's max_seq_len=32" in capsys.readouterr().err
