"""`kforge inspect-ckpt` for real, on a checkpoint written by 2-rank FSDP (torchrun, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kforge_cli import load_model
from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model import count_params
from kforge_cli.settings import load_settings
from tests.conftest import run_kforge
from tests.helpers import tiny
from tests.helpers.launch import torchrun

pytestmark = pytest.mark.e2e

MODEL = tiny.model(32, 2, 4, 2, max_seq_len=64)
ARGS = [
    *MODEL,
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--train.max_steps=4",
    "--checkpoint.interval=2",
    "--checkpoint.keep_last_n=0",
    "--eval.interval=0",
    "--scheduler.warmup_steps=1",
    "--metrics.progress_bar=off",
    *tiny.ONE_THREAD,
]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP run (dp_shard=2) with checkpoints at steps 2 and 4, and eval.tasks scored at step 4."""
    root = tmp_path_factory.mktemp("fsdp")
    run = root / "run"
    task = root / "tiny_mc.jsonl"  # 7 choices: the two ranks' shares differ, so the padding is exercised
    task.write_text("".join(json.dumps(r) + "\n" for r in TASK))
    cmd = [  # a real torchrun: kforge as its users launch it
        *torchrun(2, "-m", "kforge_cli"),
        "train",
        "--run-dir",
        str(run),
        *ARGS,
        "--eval.interval=4",
        "--eval.steps=1",
        f'--eval.tasks=["{task}"]',
    ]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run


TASK = [
    {"context": "The cat sat on the", "choices": [" mat", " moon", " xq"], "answer": 0},
    {"context": "one two three", "choices": [" four", " seven"], "answer": 0},
    {"context": "", "choices": ["hello", "zzzz"], "answer": 1},
]


def test_in_loop_eval_tasks_over_two_ranks_equal_the_one_process_scores(fsdp_run: Path) -> None:
    from kforge_cli.engine.data.tokenizer import ByteTokenizer
    from kforge_cli.engine.interop.open_checkpoint import open_for_inference
    from kforge_cli.engine.model.scoring import continuation_logliks
    from kforge_cli.engine.observe.metrics_file import read_metrics

    (logged,) = [r for r in read_metrics(fsdp_run / "metrics.jsonl") if "eval/tiny_mc/acc" in r]
    assert logged["step"] == 4
    model, tok = open_for_inference(fsdp_run / "checkpoints" / "step_4").model, ByteTokenizer()
    right = right_norm = 0
    for ex in TASK:
        lls = continuation_logliks(
            model, tok.encode(ex["context"]) or [tok.eos_id], [tok.encode(c) for c in ex["choices"]]
        )
        norm = [ll / len(c) for ll, c in zip(lls, ex["choices"], strict=True)]
        right += int(lls.index(max(lls)) == ex["answer"])
        right_norm += int(norm.index(max(norm)) == ex["answer"])
    assert (logged["eval/tiny_mc/acc"], logged["eval/tiny_mc/acc_norm"]) == (right / 3, right_norm / 3)


def inspect_json(*args: str, code: int = 0) -> dict:
    r = run_kforge("inspect-ckpt", *args, "--json")
    assert r.returncode == code, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_json_lists_every_parameter_and_the_total_is_the_model_size(fsdp_run: Path) -> None:
    data = inspect_json(str(fsdp_run / "checkpoints" / "step_4"))
    assert data["step"] == 4 and data["complete"] and data["world_size"] == 2 and data["mesh"]["dp_shard"] == 2
    assert data["tokens_seen"] == 4 * 2 * 2 * 32  # steps x ranks x batch x seq_len
    with torch.device("meta"):
        model = Transformer(load_settings(overrides=ARGS, use_env=False).settings.model)
    expected = {name: list(p.shape) for name, p in model.named_parameters()}
    listed = {t["name"].removeprefix("model."): t for t in data["tensors"] if t["name"].startswith("model.")}
    assert {k: v["shape"] for k, v in listed.items()} == expected
    assert all(t["shards"] == 2 for t in listed.values())  # FSDP2 shards every parameter over both ranks
    assert sum(t["numel"] for t in listed.values()) == data["totals"]["model"]["numel"] == count_params(model)


def test_text_output_and_run_dir_resolution(fsdp_run: Path) -> None:
    r = run_kforge("inspect-ckpt", str(fsdp_run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{fsdp_run / 'checkpoints' / 'step_4'}  [kforge, complete]" in r.stdout
    assert "step 4, 512 tokens seen" in r.stdout and "written by 2 ranks" in r.stdout
    assert "    feed_forward.w2.weight" in r.stdout and "layers.1.feed_forward.w2.weight" not in r.stdout
    full = run_kforge("inspect-ckpt", str(fsdp_run), "--all")
    assert full.returncode == 0 and "layers.1.feed_forward.w2.weight" in full.stdout


def test_tensor_statistics_match_the_loaded_model(fsdp_run: Path) -> None:
    step = fsdp_run / "checkpoints" / "step_4"
    st = inspect_json(str(step), "--tensor", "layers.0.attention.wk.weight")
    w = load_model(step).state_dict()["layers.0.attention.wk.weight"].double()
    assert st["shape"] == [16, 32] and st["shards"] == 2 and st["nan"] == 0
    assert st["mean"] == pytest.approx(float(w.mean()), rel=1e-9, abs=1e-12)
    assert st["std"] == pytest.approx(float(w.std(correction=0)), rel=1e-9)
    assert st["norm"] == pytest.approx(float(w.norm()), rel=1e-9)


def test_verify_accepts_the_checkpoint_and_fails_cleanly_on_a_truncated_shard(fsdp_run: Path, tmp_path: Path) -> None:
    good = run_kforge("inspect-ckpt", str(fsdp_run / "checkpoints" / "step_4"), "--verify")
    assert good.returncode == 0 and good.stdout.startswith("OK "), good.stderr[-3000:]
    broken = tmp_path / "step_4"
    shutil.copytree(fsdp_run / "checkpoints" / "step_4", broken)
    shard = broken / "__1_0.distcp"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size - 100)
    r = run_kforge("inspect-ckpt", str(broken), "--verify")
    assert r.returncode == 2
    assert f"{broken} failed verification" in r.stderr
    assert f"shard file {shard} is truncated: {size - 100} bytes" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_diff_of_two_steps_lists_the_changed_tensors(fsdp_run: Path) -> None:
    ckpts = fsdp_run / "checkpoints"
    data = inspect_json(str(ckpts / "step_2"), "--diff", str(ckpts / "step_4"), code=1)
    changed = {d["name"] for d in data["differing"]}
    model_tensors = {
        t["name"] for t in inspect_json(str(ckpts / "step_4"))["tensors"] if t["name"].startswith("model.")
    }
    assert model_tensors <= changed and not data["identical"]
    assert all(d["max_abs"] > 0 and d["rel_l2"] > 0 for d in data["differing"])
    text = run_kforge("inspect-ckpt", str(ckpts / "step_2"), "--diff", str(ckpts / "step_4"))
    assert text.returncode == 1 and "model.output.weight" in text.stdout  # 1: they differ, like diff
    assert f"{len(changed)} of {data['compared']} common tensors differ" in text.stdout


def test_bad_paths_and_options_are_one_line_errors(tmp_path: Path) -> None:
    r = run_kforge("inspect-ckpt", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = run_kforge("inspect-ckpt", str(tmp_path), "--verify", "--tensor", "x")
    assert r.returncode == 2 and "one of --tensor, --verify and --diff" in r.stderr
