"""Checkpoint inspection on one process: summary, tensor statistics, verify, diff, load_model, raw DCP dirs."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from kforge_cli import load_model
from kforge_cli.engine.checkpoint import CheckpointError
from kforge_cli.engine.checkpoint.dcp_io import quiet_single_process
from kforge_cli.engine.checkpoint.inspection import diff_checkpoints, summarize, tensor_stats
from kforge_cli.engine.checkpoint.reader import open_checkpoint, read_tensors
from kforge_cli.engine.checkpoint.verify import verify_checkpoint
from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model import count_params
from kforge_cli.rundir.names import COMMIT_FILE
from kforge_cli.settings import JobSettings, load_settings
from tests.helpers import tiny
from tests.helpers.tiny_run import tiny_run

TINY = [
    *tiny.TINY_MODEL,
    "--train.max_steps=20",
    "--scheduler.warmup_steps=1",
    "--optimizer.lr=1e-2",
    "--checkpoint.keep_last_n=0",
]


@dataclass
class Saved:
    settings: JobSettings
    model: torch.nn.Module
    steps: dict[int, Path]  # step -> step dir
    weights: dict[int, dict[str, torch.Tensor]]  # step -> the model's parameters when saved


def train_and_save(run_dir: Path, extra: list[str], steps: int) -> Saved:
    """`steps` AdamW steps on random tokens, a checkpoint after each (through the real CheckpointManager)."""
    s = load_settings(overrides=TINY + extra, use_env=False).settings
    run = tiny_run(run_dir, s)
    model, opt, sched, mgr, state = run.model, run.optimizer, run.scheduler, run.manager, run.state
    saved = Saved(s, model, {}, {})
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 64, (2, 17), generator=gen)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state.step, state.tokens_seen = step, step * 32
        saved.steps[step] = mgr.save(step, blocking=True)
        saved.weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return saved


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return train_and_save(tmp_path_factory.mktemp("inspect") / "run", [], steps=2)


def test_summary_lists_every_parameter_and_totals_match_the_model(run: Saved) -> None:
    s = summarize(open_checkpoint(run.steps[2]))
    assert s["format"] == "kforge" and s["complete"] and s["step"] == 2 and s["tokens_seen"] == 64
    assert s["model"]["dim"] == 32 and s["model"]["n_kv_heads"] == 2
    params = dict(run.model.named_parameters())
    listed = {t["name"].removeprefix("model."): t for t in s["tensors"] if t["name"].startswith("model.")}
    assert set(listed) == set(params)
    for name, p in params.items():
        assert listed[name]["shape"] == list(p.shape) and listed[name]["dtype"] == "float32"
        assert listed[name]["shards"] == 1 and listed[name]["bytes"] == p.numel() * 4
    assert s["totals"]["model"]["numel"] == count_params(run.model) == sum(p.numel() for p in params.values())
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a scalar step each
    assert s["totals"]["optimizer"]["numel"] == 2 * count_params(run.model) + len(params)
    assert (
        s["totals"]["files"] == run.settings.checkpoint.write_threads
        and s["totals"]["file_bytes"] > s["totals"]["all"]["bytes"]
    )
    json.dumps(s)  # the --json output is plain JSON


def test_run_dir_opens_its_newest_checkpoint(run: Saved) -> None:
    assert open_checkpoint(run.steps[2].parent.parent).path == run.steps[2]


def test_tensor_stats_equal_torch_on_the_saved_weights(run: Saved) -> None:
    w = run.weights[2]["layers.1.feed_forward.w2.weight"].to(torch.float64)
    st = tensor_stats(open_checkpoint(run.steps[2]), "layers.1.feed_forward.w2.weight")
    assert st["name"] == "model.layers.1.feed_forward.w2.weight" and st["shape"] == [32, 128]
    assert st["mean"] == pytest.approx(float(w.mean()), rel=1e-12, abs=1e-15)
    assert st["std"] == pytest.approx(float(w.std(correction=0)), rel=1e-12)
    assert (st["min"], st["max"]) == (float(w.min()), float(w.max()))
    assert st["norm"] == pytest.approx(float(w.norm()), rel=1e-12)
    assert st["nan"] == 0 and st["inf"] == 0


def test_tensor_stats_count_nan_and_skip_them(tmp_path: Path) -> None:
    t = torch.tensor([1.0, float("nan"), 3.0, float("inf"), float("nan"), 0.0])
    with quiet_single_process():
        dcp_save({"model": {"w": t}}, checkpoint_id=tmp_path, no_dist=True)
    st = tensor_stats(open_checkpoint(tmp_path), "w")
    assert (st["nan"], st["inf"], st["zeros"]) == (2, 1, 1)
    assert st["mean"] == pytest.approx(4 / 3) and st["max"] == 3.0 and st["min"] == 0.0
    assert st["norm"] == pytest.approx(10**0.5)


def test_any_dcp_directory_opens(tmp_path: Path) -> None:
    """Not written by kforge: no train state, no commit marker; tensors and shapes still listed and read."""
    state = {"model": {"a.weight": torch.arange(12.0).reshape(3, 4)}, "extra": {"b": torch.ones(2, dtype=torch.int64)}}
    with quiet_single_process():
        dcp_save(state, checkpoint_id=tmp_path, no_dist=True)
    view = open_checkpoint(tmp_path)
    assert not view.kforge and view.complete and view.step is None
    s = summarize(view)
    assert {t["name"]: t["shape"] for t in s["tensors"]} == {"model.a.weight": [3, 4], "extra.b": [2]}
    assert torch.equal(read_tensors(view, ["a.weight"])["model.a.weight"], state["model"]["a.weight"])
    assert verify_checkpoint(tmp_path).ok


def test_unknown_tensor_is_a_clear_error(run: Saved) -> None:
    with pytest.raises(CheckpointError, match="has no tensor 'layers.9.w'"):
        tensor_stats(open_checkpoint(run.steps[2]), "layers.9.w")


def test_verify_passes_on_a_good_checkpoint(run: Saved) -> None:
    report = verify_checkpoint(run.steps[2])
    n = len(open_checkpoint(run.steps[2]).tensors)
    assert report.ok and report.problems == [] and report.tensors_read == n
    assert report.files == run.settings.checkpoint.write_threads  # one shard file per writer thread
    assert report.items_read > 0


def _copy(src: Path, tmp: Path) -> Path:
    dst = tmp / src.name
    shutil.copytree(src, dst)
    return dst


def test_verify_names_a_truncated_shard(run: Saved, tmp_path: Path) -> None:
    ckpt = _copy(run.steps[2], tmp_path)
    shard = next(ckpt.glob("*.distcp"))
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(f"{shard} is truncated: {size // 2} bytes" in p for p in report.problems), report.problems
    from kforge_cli.cli.inspect_ckpt import _summary_text

    listing = _summary_text(summarize(open_checkpoint(ckpt)))  # the plain listing notices it too (sizes only)
    assert f"DAMAGED: shard file {shard} is truncated" in listing.splitlines()[0], listing.splitlines()[0]


def test_verify_reports_missing_pieces(run: Saved, tmp_path: Path) -> None:
    ckpt = _copy(run.steps[2], tmp_path)
    (ckpt / COMMIT_FILE).unlink()
    (ckpt / "train_state" / "rank_0.pt").unlink()
    next(ckpt.glob("*.distcp")).unlink()
    problems = verify_checkpoint(ckpt).problems
    assert any("kforge_commit.json is missing" in p for p in problems)
    assert any("RNG state of rank 0 is missing" in p for p in problems)
    assert any("shard file" in p and "is missing" in p for p in problems)


def test_verify_without_metadata_fails_cleanly(run: Saved, tmp_path: Path) -> None:
    ckpt = _copy(run.steps[2], tmp_path)
    (ckpt / ".metadata").unlink()
    report = verify_checkpoint(ckpt)
    assert not report.ok and "holds no DCP .metadata" in report.problems[0]


def test_diff_of_two_steps_lists_every_changed_tensor_by_how_much(run: Saved) -> None:
    a, b = open_checkpoint(run.steps[1]), open_checkpoint(run.steps[2])
    result = diff_checkpoints(a, b, model_only=True)
    assert result.compared == len(run.weights[1]) and not result.only_in_a and not result.only_in_b
    assert {d.name for d in result.differing} == {f"model.{k}" for k in run.weights[1]}  # AdamW moves every weight
    by_name = {d.name: d for d in result.differing}
    w1, w2 = run.weights[1]["output.weight"].double(), run.weights[2]["output.weight"].double()
    d = by_name["model.output.weight"]
    assert d.max_abs == pytest.approx(float((w2 - w1).abs().max()), rel=1e-12)
    assert d.rel_l2 == pytest.approx(float((w2 - w1).norm() / w1.norm()), rel=1e-12)
    assert d.changed == int((w1 != w2).sum())
    full = diff_checkpoints(a, b)
    assert any(x.name.startswith("optimizer.state.") for x in full.differing)


def test_diff_with_itself_is_identical(run: Saved) -> None:
    view = open_checkpoint(run.steps[2])
    result = diff_checkpoints(view, view)
    assert result.identical and result.compared == len(view.tensors)


def test_load_model_returns_the_saved_weights_in_eval_mode(run: Saved) -> None:
    model = load_model(run.steps[1])
    assert isinstance(model, Transformer) and not model.training
    for name, value in model.state_dict().items():
        assert torch.equal(value, run.weights[1][name]), name
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    reference = Transformer(run.settings.model)
    reference.load_state_dict(run.weights[1])
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
        assert model(tokens).shape == (2, 16, 64)


def test_load_model_refuses_an_incomplete_checkpoint(run: Saved, tmp_path: Path) -> None:
    ckpt = _copy(run.steps[2], tmp_path)
    (ckpt / COMMIT_FILE).unlink()
    assert not open_checkpoint(ckpt).complete
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        load_model(ckpt)


def test_load_model_in_bf16(run: Saved) -> None:
    model = load_model(run.steps[2], dtype=torch.bfloat16)
    assert model.tok_embeddings is not None and model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.rope_cos.dtype == torch.float32  # RoPE tables stay fp32
    assert torch.equal(model.tok_embeddings.weight, run.weights[2]["tok_embeddings.weight"].to(torch.bfloat16))


def test_load_model_from_a_plain_dcp_dir_needs_the_model_settings(run: Saved, tmp_path: Path) -> None:
    with quiet_single_process():
        dcp_save({"model": dict(run.weights[2])}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(CheckpointError, match="does not say which model"):
        load_model(tmp_path)
    model = load_model(tmp_path, model_settings=run.settings.model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, run.weights[2][name]), name


def test_cli_summary_groups_blocks_one_optimizer_line_per_kind_and_fits_100_columns(
    run: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.app import main

    def cli(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(["inspect-ckpt", *args])
        return int(exit_info.value.code or 0), capsys.readouterr().out

    code, text = cli(str(run.steps[2]))
    lines = text.splitlines()
    assert code == 0 and all(len(line) <= 100 for line in lines[1:]), max(lines[1:], key=len)
    n_params = len(dict(run.model.named_parameters()))
    block = [n for n, _ in run.model.named_parameters() if n.startswith("layers.0.")]
    per_block = sum(p.numel() for n, p in run.model.named_parameters() if n.startswith("layers.0."))
    row = next(line for line in lines if line.startswith("layers.0-1 "))
    assert row.split()[1:6] == ["2", "blocks", "x", str(len(block)), "float32"]
    assert row.split()[6] == f"{2 * per_block:,}"
    spelled = [line.split()[0] for line in lines if line.startswith("    ")]
    assert spelled == [n.removeprefix("layers.0.") for n in block]  # one block spelled out, not both
    assert not any(line.startswith("layers.1.") or "optimizer.state." in line for line in lines)
    start = next(i for i, line in enumerate(lines) if line.startswith("optimizer state "))
    end = lines.index("", start)
    kinds = {line.split()[0]: line.split()[1] for line in lines[start + 1 : end]}
    assert kinds == {"step": str(n_params), "exp_avg": str(n_params), "exp_avg_sq": str(n_params)}, kinds
    code, full = cli(str(run.steps[2]), "--all")
    full_lines = full.splitlines()
    assert code == 0 and all(len(line) <= 100 for line in full_lines[1:])
    assert sum(line.startswith("state.") for line in full_lines) == 3 * n_params  # every optimizer tensor
    assert sum(line.startswith("layers.") for line in full_lines) == 2 * len(block)


def test_cli_diff_exits_1_when_the_checkpoints_differ_and_0_when_identical(
    run: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    from kforge_cli.cli.app import main

    for other, json_flag, expected in (
        (run.steps[1], [], 1),
        (run.steps[1], ["--json"], 1),
        (run.steps[2], [], 0),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["inspect-ckpt", str(run.steps[2]), "--diff", str(other), *json_flag])
        assert exit_info.value.code == expected, (other, json_flag)
    out = capsys.readouterr().out
    assert "common tensors differ" in out and '"identical": false' in out and "0 of " in out
