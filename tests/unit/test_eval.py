"""`kforge eval`: held-out loss equals the run's own eval_loss; multiple-choice scores equal transformers'.

One tiny training run through the real loop (built-in byte corpus, 3 steps, an eval at
step 3 and a checkpoint at the end) serves every test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kforge_cli.engine.evaluation.tasks import multiple_choice, run_task
from kforge_cli.engine.interop.open_checkpoint import open_for_inference
from kforge_cli.engine.model.scoring import continuation_logliks
from kforge_cli.engine.observe.metrics_file import read_metrics
from kforge_cli.errors import InvalidInputError
from tests.helpers import tiny

TINY = [
    *tiny.model(32, 2, 4, max_seq_len=64),
    "--train.seq_len=32",
    "--train.batch_size=4",
    "--train.max_steps=3",
    "--scheduler.warmup_steps=1",
    *tiny.QUIET,
    "--eval.interval=3",
    "--eval.steps=3",
    "--eval.batch_size=2",
    "--checkpoint.interval=0",
]
TASK = [
    {"context": "The cat sat on the", "choices": [" mat", " moon", " xq"], "answer": 0},
    {"context": "one two three", "choices": [" four", " seven"], "answer": 0},
    {"context": "", "choices": ["hello", "zzzz"], "answer": 1},
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kforge_cli.engine.train import run_training
    from kforge_cli.settings import load_settings

    root = tmp_path_factory.mktemp("eval")
    out, task = root / "run", _task_file(root)
    overrides = [*TINY, f"--train.run_dir={out}", f'--eval.tasks=["{task}"]']  # in-loop scoring too
    settings = load_settings(overrides=overrides, use_env=False).settings
    assert run_training(settings).status == "completed"
    return out


def _task_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TASK))
    return path


def test_heldout_loss_capped_equals_the_runs_own_eval_loss(run_dir: Path) -> None:
    (logged,) = [r["eval_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r]
    got = run_task(open_for_inference(run_dir), "heldout", max_batches=3)  # eval.steps = 3
    assert got["loss"] == pytest.approx(logged, rel=1e-6)
    assert got["perplexity"] == pytest.approx(torch.tensor(logged).exp().item(), rel=1e-5)
    assert got["tokens"] == 3 * 2 * 32 and got["batches"] == 3


def test_heldout_loss_covers_the_whole_validation_split_by_default(run_dir: Path) -> None:
    from kforge_cli.engine.data.bundle import build_data
    from kforge_cli.engine.data.tokens import make_batch
    from kforge_cli.engine.evaluation.tasks import run_settings
    from kforge_cli.engine.train.loss import build_loss_fn

    loaded = open_for_inference(run_dir)
    settings = run_settings(loaded)
    val = build_data(settings, dp_rank=0, dp_size=1).val
    assert val is not None
    windows = sum(w.num_windows for w in val.windows)
    assert windows > 3 * 2  # more than training's 3 eval batches of 2
    got = run_task(loaded, "heldout")
    assert got["batches"] == -(-windows // 2)
    # every window once: the token-weighted mean of each window's own loss
    loss_fn = build_loss_fn(settings)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for w in val.windows:
            for i in range(w.num_windows):
                one = make_batch(w.rows(np.array([i])), np.zeros(1, dtype=np.int64), val.eos_id, val.document_masking)
                kwargs = {k: one[k] for k in ("doc_ids", "positions") if k in one}
                total += float(loss_fn.from_logits(loaded.model(one["input_ids"], **kwargs).float(), one["labels"]))
                tokens += int((one["labels"] != -100).sum())
    assert got["tokens"] == tokens
    assert got["loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_multiple_choice_logliks_equal_transformers_on_the_export(run_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from kforge_cli.engine.interop.hf_export import export_hf

    loaded = open_for_inference(run_dir)
    hf_dir = export_hf(loaded.path, tmp_path / "hf").out_dir
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tok = loaded.tokenizer
    for ex in TASK:
        context = tok.encode(ex["context"]) or [tok.eos_id]
        conts = [tok.encode(c) for c in ex["choices"]]
        ours = continuation_logliks(loaded.model, context, conts)
        for cont, mine in zip(conts, ours, strict=True):
            seq = torch.tensor([context + cont])
            with torch.no_grad():
                logp = hf(seq[:, :-1]).logits[0].float().log_softmax(-1)
            theirs = logp[-len(cont) :].gather(1, torch.tensor(cont)[:, None]).sum().item()
            assert mine == pytest.approx(theirs, abs=1e-5)
    # accuracy follows from those numbers: recompute it independently
    metrics = multiple_choice(loaded, _task_file(tmp_path))
    right = right_norm = 0
    for ex in TASK:
        lls = continuation_logliks(
            loaded.model, tok.encode(ex["context"]) or [tok.eos_id], [tok.encode(c) for c in ex["choices"]]
        )
        right += int(lls.index(max(lls)) == ex["answer"])
        normed = [ll / len(c) for ll, c in zip(lls, ex["choices"], strict=True)]
        right_norm += int(normed.index(max(normed)) == ex["answer"])
    assert metrics == {"acc": right / 3, "acc_norm": right_norm / 3, "examples": 3.0}


def test_cli_eval_writes_json_and_logs_at_the_checkpoint_step(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.app import main

    task = _task_file(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["eval", str(run_dir), "--task", "heldout", "--task", str(task), "--track"])  # asked to log
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "heldout" in out and "acc_norm" in out
    assert "heldout: " in out and " tokens in " in out and "the whole validation split" in out
    saved = json.loads((run_dir / "eval" / "step_3.json").read_text())
    assert saved["step"] == 3 and set(saved["tasks"]) == {"heldout", "tiny_mc"}
    last = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 3 and last["eval/heldout/loss"] == pytest.approx(saved["tasks"]["heldout"]["loss"])
    assert last["eval/tiny_mc/acc"] == saved["tasks"]["tiny_mc"]["acc"]


def test_in_loop_eval_tasks_log_what_kforge_eval_computes_at_that_step(run_dir: Path, tmp_path: Path) -> None:
    logged = next(r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/tiny_mc/acc" in r)  # training's
    assert logged["step"] == 3
    offline = multiple_choice(open_for_inference(run_dir / "checkpoints" / "step_3"), _task_file(tmp_path))
    assert (logged["eval/tiny_mc/acc"], logged["eval/tiny_mc/acc_norm"]) == (offline["acc"], offline["acc_norm"])


def test_a_bad_task_file_names_the_line_and_field(run_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TASK[0]) + "\n" + json.dumps({**TASK[1], "answer": 5}) + "\n")
    with pytest.raises(InvalidInputError, match=r"bad.jsonl:2: 'answer' must be the index of a choice \(0..1\)"):
        run_task(open_for_inference(run_dir), str(bad))
    with pytest.raises(InvalidInputError, match="unknown task 'mmlu'"):
        run_task(open_for_inference(run_dir), "mmlu")


def test_lm_eval_adapter_scores_like_our_own_scoring(run_dir: Path) -> None:
    pytest.importorskip("lm_eval")
    from kforge_cli.engine.evaluation.lm_eval_adapter import make_adapter

    loaded = open_for_inference(run_dir)
    adapter = make_adapter(loaded)

    class Req:
        args = ("The cat sat on the", " mat")

    ((ll, _),) = adapter.loglikelihood([Req()])
    tok = loaded.tokenizer
    assert ll == pytest.approx(continuation_logliks(loaded.model, tok.encode(Req.args[0]), [tok.encode(" mat")])[0])


def test_heldout_states_its_batch_count_and_a_tokenizer_clash_names_both_tokenizers(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.app import main
    from kforge_cli.engine.data.prepare.prepare_run import prepare_data
    from tests.unit.test_data_tokens import _bpe_file

    with pytest.raises(SystemExit) as done:
        main(["eval", str(run_dir), "--task", "heldout", "--no-log"])
    assert done.value.code == 0
    got = run_task(open_for_inference(run_dir), "heldout")  # the whole validation split by default
    assert got["batches"] >= 1 and got["tokens"] > 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("heldout: "))
    assert (
        line == f"heldout: {int(got['tokens']):,} tokens in {int(got['batches'])} batches, the whole validation split"
    )
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat\n" * 200)
    bpe = tmp_path / "bpe"
    prepare_data([text], bpe, tokenizer=str(_bpe_file(tmp_path, ["<|endoftext|>"])), val_fraction=0.1, workers=1)
    with pytest.raises(InvalidInputError) as err:
        run_task(open_for_inference(run_dir), f"heldout:{bpe}")
    message = str(err.value)
    assert message.startswith(f"--task heldout:{bpe}: that directory was prepared with a tokenizer.json (vocab ")
    assert "the run was trained on the built-in corpus with the byte tokenizer" in message
    assert "eval.path" not in message and "--tokenizer byte" in message


def test_generate_names_a_bad_prompt_by_its_place_counting_from_1(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.app import main

    for prompts, message in (
        (["The cat", "", "A dog"], "prompt 2 is empty"),
        (["The cat", "A dog", "x" * 100], "prompt 3 is 100 tokens, longer than the model's max_seq_len=64"),
    ):
        args = [a for p in prompts for a in ("-p", p)]
        with pytest.raises(SystemExit) as done:
            main(["generate", str(run_dir), *args, "--max-new-tokens", "2"])
        err = capsys.readouterr()
        assert done.value.code == 2 and message in err.err, err.err
        assert err.out == ""  # nothing generated before the check
