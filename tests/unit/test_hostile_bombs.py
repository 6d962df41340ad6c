"""Memory and time bombs: bounded by what is stored, never by what a file claims (issue 29, class 7).

A checkpoint's shaping record claiming a huge vocabulary, context or depth is checked
against the stored tensors before anything is allocated; the KV cache holds prompt + new
tokens, not max_seq_len; a train state's world_size is checked against the files there;
metrics.jsonl is streamed (plot samples it); a multiple-choice context is cut to what
the model can see before it is tokenized. Peak RSS and wall time: bench/hostile_bombs.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.interop.load_model import load_model
from tests.unit.test_checkpoint_hostile import saved


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved(tmp_path_factory.mktemp("bombs") / "run")[0]


def claiming(step: Path, dest: Path, **claims: int) -> Path:
    """A copy of checkpoint `step` whose shaping record claims `claims` (model.* fields)."""
    copy = Path(shutil.copytree(step, dest / step.name))
    state = json.loads((copy / "train_state.json").read_text())
    state["shaping"].update({f"model.{k}": v for k, v in claims.items()})
    (copy / "train_state.json").write_text(json.dumps(state))
    return copy


@pytest.mark.parametrize(
    ("claims", "match"),
    [
        ({"vocab_size": 10**9}, r"(output|tok_embeddings)\.weight is stored as \(64, 32\), but the config describes"),
        ({"max_seq_len": 2**23}, r"max_seq_len=8388608 would need 512 MiB of RoPE tables for 0\.\d MiB of weights"),
        ({"n_layers": 2000}, r"claims n_layers=2000, but only \d+ tensors are stored"),
    ],
    ids=["vocab", "context", "depth"],
)
def test_a_shaping_record_is_checked_against_the_stored_tensors_before_allocating(
    honest: Path, tmp_path: Path, claims: dict[str, int], match: str
) -> None:
    bomb = claiming(honest, tmp_path, **claims)
    with pytest.raises(CheckpointError, match=match):
        load_model(bomb)
    assert isinstance(load_model(honest), torch.nn.Module)  # the honest one still loads


def test_the_kv_cache_holds_prompt_plus_new_tokens_not_max_seq_len(
    honest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kforge_cli.engine.model import generation
    from kforge_cli.settings.training import ModelSettings

    model = load_model(honest)
    long_context = ModelSettings.model_validate(model.cfg.model_dump() | {"max_seq_len": 4096})
    model.cfg = long_context  # what a 4096-position model looks like to generation (tables are not used past 9)
    model.rope_cos, model.rope_sin = (t.repeat(128, 1) for t in (model.rope_cos, model.rope_sin))
    sizes: list[int] = []
    real = generation.KVCache

    def spy(max_len: int) -> generation.KVCache:
        sizes.append(max_len)
        return real(max_len)

    monkeypatch.setattr(generation, "KVCache", spy)
    out = list(generation.generate_tokens(model, [1, 2, 3], max_new_tokens=6))
    assert len(out) == 6 and sizes == [3 + 6]


def test_world_size_in_a_train_state_is_checked_against_the_rank_files_present(honest: Path, tmp_path: Path) -> None:
    from kforge_cli.engine.checkpoint.verify import verify_checkpoint

    copy = Path(shutil.copytree(honest, tmp_path / honest.name))
    state = json.loads((copy / "train_state.json").read_text())
    state["world_size"] = 300_000
    (copy / "train_state.json").write_text(json.dumps(state))
    problems = verify_checkpoint(copy).problems
    missing = [p for p in problems if "RNG state" in p]
    assert missing == [
        f"RNG state of 299999 of the 300000 ranks train_state.json names is missing ({copy / 'train_state'} holds "
        "files of 1)"
    ]
    state["world_size"] = 3  # a few missing ranks are still named one by one
    (copy / "train_state.json").write_text(json.dumps(state))
    assert [p for p in verify_checkpoint(copy).problems if "RNG state" in p] == [
        "RNG state of rank 1 is missing (rank_1.json / rank_1.pt)",
        "RNG state of rank 2 is missing (rank_2.json / rank_2.pt)",
    ]


def _damaged_metrics(run: Path, honest_steps: int) -> None:
    """Honest records around a 3 MB line, deep nesting, a \\xff byte and a 5000-digit number."""
    run.mkdir(parents=True, exist_ok=True)
    rows = [json.dumps({"step": s, "loss": 1.0 / s, "tokens_seen": 64 * s}).encode() for s in range(1, honest_steps)]
    bombs = [
        b'{"step": 1, "x": "' + b"a" * (3 << 20) + b'"}',
        b"[" * 100_000,
        b'{"step": 2, "loss": 1.0, "\xff": 1}',
        b'{"step": 3, "loss": ' + b"9" * 5000 + b"}",
    ]
    last = json.dumps({"step": honest_steps, "loss": 0.25, "eval_loss": 0.5, "tokens_seen": 64 * honest_steps})
    (run / "metrics.jsonl").write_bytes(b"\n".join([*bombs, *rows, last.encode()]) + b"\n")


def test_runs_and_plot_stream_a_damaged_metrics_file(tmp_path: Path) -> None:
    from kforge_cli.cli.runs_table import describe_run
    from kforge_cli.engine.observe.curves import MAX_POINTS, plot_runs

    run = tmp_path / "run"
    _damaged_metrics(run, 3 * MAX_POINTS)
    row = describe_run(run)
    assert (row.steps_done, row.last_loss, row.eval_loss) == (3 * MAX_POINTS, 0.25, 0.5)
    fig = plot_runs([run], tmp_path / "curves.png", ["loss"])
    (line,) = fig.axes[0].get_lines()
    steps = list(line.get_xdata())
    assert len(steps) <= MAX_POINTS + 1 and steps[-1] == 3 * MAX_POINTS  # sampled, ends where the run is
    assert steps[:3] == [4, 8, 12]  # every 4th step (60004 lines / 20000 points; damaged lines skipped)


def test_a_huge_multiple_choice_context_is_cut_before_it_is_tokenized(
    honest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kforge_cli.engine.evaluation.tasks import multiple_choice
    from kforge_cli.engine.interop.open_checkpoint import open_for_inference

    task = tmp_path / "big.jsonl"
    record = {"context": "word " * 400_000, "choices": [" a", " b"], "answer": 0}  # 2 MB of context
    task.write_text(json.dumps(record) + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "word": 1, "a": 2, "b": 3, "<|endoftext|>": 4}, "[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    loaded = open_for_inference(honest, tokenizer=str(tmp_path / "words.json"))  # 5 ids: fits the 64 of the model
    seen: list[int] = []
    encode = loaded.tokenizer.encode
    monkeypatch.setattr(loaded.tokenizer, "encode", lambda text: (seen.append(len(text)), encode(text))[1])
    result = multiple_choice(loaded, task)
    assert result["examples"] == 1.0
    assert max(seen) <= 64 * loaded.model.cfg.max_seq_len  # 2048 characters for this 32-position model
