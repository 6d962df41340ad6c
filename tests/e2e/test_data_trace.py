"""`kforge data-trace RUN --step N` lists what the loader really gave each step (issue 46).

A two-dataset mixture with a phase trains as 2 gloo ranks with gradient accumulation and a hook
that records every micro-batch the step received; it is resumed on 1 rank with another
accumulation. For every step, the samples data-trace lists (dataset, shard, offset, length),
re-read from the shards, are the recorded batches row for row, and the steps before the resume
trace the same before and after it. A loss-spike rewind: the steps after it trace to the data
after the skipped window, which is what they trained on.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import tiny
from tests.helpers.batch_hooks import recorded
from tests.helpers.launch import kforge_ranks, with_repo_path

pytestmark = pytest.mark.e2e

EOS = 256  # the byte tokenizer's
SEQ = 16
HOOK = '--train.hooks=["tests.helpers.batch_hooks:RecordBatches"]'
ALLOW = "--allow-hooks=tests.helpers.batch_hooks"


def _prepared(root: Path) -> dict[str, Path]:
    """Two byte-tokenized datasets of short documents in shards of 1000 tokens (windows straddle shards)."""
    from kforge_cli.engine.data.prepare import prepare_data

    rng, out = random.Random(7), {}
    words = ["fox", "cat", "the", "ran", "over", "hill", "mill", "river"]
    for name in ("web", "books"):
        src = root / f"{name}.jsonl"
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(300)]
        src.write_text("".join(json.dumps({"text": f"{name}: {d}"}) + "\n" for d in docs))
        out[name] = root / f"data_{name}"
        prepare_data([src], out[name], tokenizer="byte", val_fraction=0.0, workers=1, shard_tokens=1000)
    return out


def _args(data: dict[str, Path]) -> list[str]:
    mixture = ",".join(f'{{name="{n}",path="{p}",weight={w}}}' for (n, p), w in zip(data.items(), (1, 2), strict=True))
    return [
        *tiny.model(32, 2, 4, 2, vocab_size=320, max_seq_len=SEQ),
        f"--train.seq_len={SEQ}",
        *tiny.CPU_FP32,
        *tiny.QUIET,
        "--train.batch_size=2",
        f"--data.datasets=[{mixture}]",
        "--data.document_masking=true",
        "--data.phases=[{start_step=3,dataset_weights={web=3.0,books=1.0}}]",
    ]


def _trace(kforge: Any, run: Path, step: int, *extra: str) -> dict[str, Any]:
    """`kforge data-trace RUN --step N --json`, the real command."""
    r = kforge("data-trace", str(run), "--step", str(step), "--json", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _traces(kforge: Any, run: Path, steps: range) -> dict[int, dict[str, Any]]:
    """The trace of every step: two by the command, the rest by its function in this process (the
    command prints that function's answer: the two agree)."""
    from kforge_cli.engine.data.trace import trace_step

    out = {s: json.loads(json.dumps(trace_step(run, s).to_dict())) for s in steps}
    for s in (steps[0], steps[-1]):
        assert _trace(kforge, run, s) == out[s]
    return out


def _reread(sample: dict[str, Any]) -> np.ndarray:
    parts = [np.load(p["shard"], mmap_mode="r")[p["offset"] : p["offset"] + p["length"]] for p in sample["pieces"]]
    return np.concatenate(parts).astype(np.int64)


def assert_trace_is_what_the_step_got(trace: dict[str, Any], kept: dict[tuple[int, int, int], Any]) -> None:
    """Every sample listed, re-read from its shards, is its row of the recorded micro-batch; nothing is missing."""
    step, names = trace["step"], list(trace["datasets"])
    mine = {k: v for k, v in kept.items() if k[0] == step and (trace["rank"] is None or k[2] == trace["rank"])}
    listed = {(step, s["micro_batch"], s["rank"]) for s in trace["samples"]}
    assert listed == set(mine), (step, sorted(listed), sorted(mine))
    assert len(trace["samples"]) == sum(len(b["input_ids"]) for b in mine.values())
    for s in trace["samples"]:
        batch, row = mine[(step, s["micro_batch"], s["rank"])], s["row"]
        tokens = _reread(s)
        assert s["length"] == len(tokens) == SEQ + 1
        assert batch["input_ids"][row] == tokens[:-1].tolist(), (step, s)
        labels = np.asarray(batch["labels"][row])
        assert ((labels == tokens[1:]) | (labels == -100)).all() and (labels != -100).any()
        assert batch["dataset_ids"][row] == names.index(s["dataset"])
        assert s["document_ends"] == np.flatnonzero(tokens == EOS).tolist()


def test_data_trace_is_what_each_step_read_across_a_resume_on_fewer_ranks(kforge: Any, tmp_path: Path) -> None:
    data = _prepared(tmp_path)
    run, batches = tmp_path / "run", tmp_path / "batches"
    env = {**with_repo_path(os.environ), "OMP_NUM_THREADS": "1", "KFORGE_TEST_BATCHES": str(batches)}
    args = [*_args(data), "--train.grad_accum_steps=2", "--train.max_steps=4", "--checkpoint.interval=2", HOOK]
    for code, log in kforge_ranks(2, run, args, env=env):
        assert code == 0, log[-3000:]
    before = {s: _trace(kforge, run, s) for s in (2, 4)}
    assert (before[2]["dp_size"], before[2]["grad_accum_steps"], before[2]["world_size"]) == (2, 2, 2)

    # One rank, three micro-batches a step from the checkpoint of step 4 on (a typed change of the mesh),
    # and a phase that draws only books from step 2: in force from step 5, where the resume begins.
    books = "--data.phases=[{start_step=2,dataset_weights={books=1.0}}]"
    r = kforge("resume", str(run), ALLOW, "--train.max_steps=7", "--train.grad_accum_steps=3", books, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = recorded(batches)
    assert sorted({k[0] for k in kept}) == list(range(1, 8))
    traces = _traces(kforge, run, range(1, 8))
    for step, trace in traces.items():
        assert_trace_is_what_the_step_got(trace, kept)
        assert trace["trained"] and trace["rank"] is None
        assert (trace["dp_size"], trace["grad_accum_steps"]) == ((2, 2) if step <= 4 else (1, 3))
        if step in before:
            assert trace == before[step]  # the same answer before and after the resume
    samples = [s for t in traces.values() for s in t["samples"]]
    assert {s["dataset"] for t in list(traces.values())[1:4] for s in t["samples"]} == {"web", "books"}
    assert {s["dataset"] for t in list(traces.values())[4:] for s in t["samples"]} == {"books"}
    assert any(len(s["pieces"]) == 2 for s in samples)  # a window across two shards is read from both
    assert any(s["document_ends"] for s in samples)
    # The command builds no model and imports no torch (a fresh interpreter, as a user runs it).
    code = (
        "import sys\nfrom kforge_cli.cli.app import main\n"
        f"try:\n    main(['data-trace', {str(run)!r}, '--step', '5', '--json'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "TORCH False" in r.stderr and json.loads(r.stdout) == traces[5], r.stderr[-3000:]
    one = _trace(kforge, run, 3, "--rank", "1")
    assert_trace_is_what_the_step_got(one, kept)
    assert {s["rank"] for s in one["samples"]} == {1}

    # What a user can get wrong: exit 2 naming the argument, no traceback.
    for bad, named in (
        (["--step", "5", "--rank", "1"], "--rank 1"),
        (["--step", "8"], "--step 8"),
        (["--step", "0"], "--step 0"),
    ):
        r = kforge("data-trace", str(run), *bad)
        assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = kforge("data-trace", str(tmp_path / "nothing"), "--step", "1")
    assert r.returncode == 2 and "not a kforge run directory" in r.stderr, r.stderr


def test_after_a_loss_spike_rewind_the_steps_trace_to_the_data_after_the_skipped_window(
    kforge: Any, tmp_path: Path
) -> None:
    data = _prepared(tmp_path)
    run, batches = tmp_path / "run", tmp_path / "batches"
    env = {**with_repo_path(os.environ), "KFORGE_TEST_BATCHES": str(batches), "KFORGE_TEST_SPIKE_STEP": "10"}
    args = [
        *_args(data),
        "--train.max_steps=14",
        "--checkpoint.interval=6",
        "--resilience.spike_policy=rewind",
        "--resilience.spike_window=4",
        '--train.hooks=["tests.helpers.batch_hooks:RecordBatchesAndSpike"]',
    ]
    r = kforge("train", "--run-dir", str(run), *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the data of steps 7-10 is skipped" in r.stderr, r.stderr[-3000:]
    kept = recorded(batches)  # steps 7-10 ran twice: the later batches are the ones kept
    traces = _traces(kforge, run, range(1, 15))
    skip = {"spike_step": 10, "detected_at": 10, "rewound_to": 6, "skipped_steps": 4}
    for step, trace in traces.items():
        assert_trace_is_what_the_step_got(trace, kept)
        assert trace["rewinds"] == ([skip] if 7 <= step <= 10 else []), step
    # Step 7 (after the rewind) reads what step 11 would have: 4 steps of 2 samples are skipped for good.
    assert traces[7]["global_sample"] == traces[6]["global_sample"] + 2 + 4 * 2
    first = [json.loads(line) for line in (batches / "rank0.jsonl").read_text().splitlines()][6:10]
    assert [b["step"] for b in first] == [7, 8, 9, 10]  # the first attempt of steps 7-10
    read_later = [kept[(s, 0, 0)]["input_ids"] for s in range(7, 15)]
    assert not any(b["input_ids"] == later for b in first for later in read_later)
