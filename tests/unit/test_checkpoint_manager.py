"""CheckpointManager on one process: exact restore of every piece, async staging, latest, warm start."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kforge_cli.engine.checkpoint import CheckpointError, read_latest
from kforge_cli.engine.checkpoint.dcp_io import OPTIONS
from tests.helpers.tiny_run import TinyRun, tiny_run, tiny_settings

TINY = [  # on top of tests.helpers.tiny_run.TINY_MODEL
    "--train.max_steps=20",
    "--scheduler.warmup_steps=3",
    "--optimizer.lr=1e-2",
    "--checkpoint.keep_last_n=0",
]


Run = TinyRun


def make_run(run_dir: Path, extra: list[str] | None = None) -> TinyRun:
    return tiny_run(run_dir, tiny_settings(*TINY, *(extra or [])))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (2, 17), generator=g)


def train(run: Run, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        tokens = batch(run.state.step)
        loss = F.cross_entropy(run.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        run.state.step += 1
        run.state.tokens_seen += tokens.numel()
        run.loader.position += 2
        losses.append(loss.item())
    return losses


def full_state(run: Run) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(run.model, run.optimizer, options=OPTIONS)
    out = {**{f"m.{k}": v for k, v in model_sd.items()}, **{f"o.{k}": v for k, v in optim_sd.items()}}
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_resume_restores_everything_exactly_and_continues_bit_exact(tmp_path: Path) -> None:
    a = make_run(tmp_path)
    a.manager.restore()
    train(a, 4)
    a.guard.total_bad = 2
    a.manager.save(4, metrics_run_ids={"wandb": "abc123"})
    expected = full_state(a)
    draws = (torch.rand(3), random.random(), float(np.random.rand()))
    # A second process: different init seed (not model-shaping), restored from the checkpoint.
    b = make_run(tmp_path, ["--train.seed=7"])
    assert not torch.equal(next(b.model.parameters()), next(a.model.parameters()))
    restored = b.manager.restore()
    assert restored is not None and restored.kind == "resume" and restored.step == 4
    assert b.manager.restored_metrics_run_ids == {"wandb": "abc123"}
    assert (b.state.step, b.state.tokens_seen, b.loader.position, b.guard.total_bad) == (4, 4 * 34, 8, 2)
    assert_same(full_state(b), expected)  # weights, Adam moments and step by parameter name, param groups
    assert b.scheduler.last_epoch == 4 and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1] and np.random.rand() == draws[2]
    assert train(b, 3) == train(a, 3)  # the same losses, bit for bit


def test_layout_latest_and_retention(tmp_path: Path) -> None:
    a = make_run(tmp_path, ["--checkpoint.keep_last_n=2"])
    a.manager.restore()
    for step in (1, 2, 3, 4):
        train(a, 1)
        a.manager.save(step)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_3", "step_4"]
    assert (root / "latest").read_text() == "step_4\n" and read_latest(root) == root / "step_4"
    files = {p.name for p in (root / "step_4").iterdir()}
    assert {".metadata", "kforge_commit.json", "train_state.json", "metadata.json", "train_state"} <= files
    assert {p.name for p in (root / "step_4" / "train_state").iterdir()} == {"rank_0.json", "rank_0.pt"}


def test_incomplete_newest_checkpoint_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = make_run(tmp_path)
    a.manager.restore()
    train(a, 2)
    a.manager.save(2)
    train(a, 1)
    a.manager.save(3)
    (tmp_path / "checkpoints" / "step_3" / "kforge_commit.json").unlink()  # as if killed before the commit
    b = make_run(tmp_path)
    restored = b.manager.restore()
    assert restored is not None and restored.step == 2 and b.state.step == 2
    assert "skipping incomplete checkpoint" in caplog.text and "step_3" in caplog.text


def test_async_save_snapshots_at_call_time_and_commits(tmp_path: Path) -> None:
    a = make_run(tmp_path, ["--checkpoint.async_mode=async"])
    a.manager.restore()
    train(a, 2)
    a.manager.save(2)
    expected = full_state(a)
    train(a, 2)  # keeps training while the save may still be writing
    a.manager.wait()
    assert a.manager.history[0].mode == "async" and a.manager.history[0].total_s is not None
    assert read_latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_2"
    b = make_run(tmp_path, ["--checkpoint.resume=require"])
    b.manager.restore()
    assert_same(full_state(b), expected)


def test_resume_with_other_model_shape_is_refused(tmp_path: Path) -> None:
    a = make_run(tmp_path)
    a.manager.restore()
    train(a, 1)
    a.manager.save(1)
    b = make_run(tmp_path, ["--model.n_layers=3"])
    with pytest.raises(CheckpointError, match=r"model\.n_layers: 2 -> 3") as err:
        b.manager.restore()
    assert err.value.exit_code == 2 and "init_from" in str(err.value)


def test_resume_require_without_checkpoint_is_an_error(tmp_path: Path) -> None:
    a = make_run(tmp_path, ["--checkpoint.resume=require"])
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        a.manager.restore()


def test_warm_start_loads_weights_only_with_exclusions(tmp_path: Path) -> None:
    src = make_run(tmp_path / "src")
    src.manager.restore()
    train(src, 3)
    src.manager.save(3)
    weights = {k: v.clone() for k, v in src.model.state_dict().items()}
    b = make_run(
        tmp_path / "new",
        [
            "--train.seed=9",
            f"--checkpoint.init_from={tmp_path / 'src'}",
            "--checkpoint.exclude_from_loading=['output.*', 'layers.1']",
        ],
    )
    fresh = {k: v.clone() for k, v in b.model.state_dict().items()}
    restored = b.manager.restore()
    assert restored is not None and restored.kind == "warm_start" and b.state.step == 0
    assert b.scheduler.last_epoch == 0 and not b.optimizer.state
    for k, v in b.model.state_dict().items():
        excluded = k.startswith("output.") or k.startswith("layers.1.")
        assert torch.equal(v, fresh[k] if excluded else weights[k]), k
    # A warm-started run that saved its own checkpoint resumes from it, not from init_from again.
    train(b, 1)
    b.manager.save(1)
    c = make_run(tmp_path / "new", [f"--checkpoint.init_from={tmp_path / 'src'}"])
    assert c.manager.restore().kind == "resume"  # type: ignore[union-attr]


def test_warm_start_shape_mismatch_and_missing_names_are_clear(tmp_path: Path) -> None:
    src = make_run(tmp_path / "src")
    src.manager.restore()
    src.manager.save(0)
    wide = make_run(tmp_path / "wide", ["--model.dim=64", f"--checkpoint.init_from={tmp_path / 'src'}"])
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.attention\.wk\.weight: checkpoint \(16, 32\), this model \(32, 64\)"
    ):
        wide.manager.restore()
    deep = make_run(tmp_path / "deep", ["--model.n_layers=3", f"--checkpoint.init_from={tmp_path / 'src'}"])
    with pytest.raises(CheckpointError, match=r"no weights for layers\.2\..*exclude_from_loading"):
        deep.manager.restore()
    ok = make_run(
        tmp_path / "ok",
        [
            "--model.n_layers=3",
            f"--checkpoint.init_from={tmp_path / 'src'}",
            "--checkpoint.exclude_from_loading=['layers.2']",
        ],
    )
    assert ok.manager.restore().kind == "warm_start"  # type: ignore[union-attr]


def test_load_path_then_own_progress(tmp_path: Path) -> None:
    src = make_run(tmp_path / "src")
    src.manager.restore()
    train(src, 2)
    src.manager.save(2)
    load = f"--checkpoint.load_path={tmp_path / 'src' / 'checkpoints' / 'step_2'}"
    b = make_run(tmp_path / "b", [load])
    assert b.manager.restore().step == 2  # type: ignore[union-attr]
    train(b, 1)
    b.manager.save(3)
    c = make_run(tmp_path / "b", [load])  # a requeue with the same settings continues its own progress
    assert c.manager.restore().step == 3  # type: ignore[union-attr]


def test_async_staging_is_allocated_once_waits_are_counted_and_every_save_reports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading
    from concurrent.futures import Future

    a = make_run(tmp_path, ["--checkpoint.async_mode=async", "--checkpoint.write_threads=2"])
    a.manager.restore()
    records: list[dict[str, Any]] = []
    a.manager.report = records.append
    train(a, 1)
    a.manager.save(1)
    a.manager.wait()
    stager = a.manager._stager
    assert stager is not None
    first = stager.buffer_ptrs()
    assert a.manager.staged_nbytes == a.manager.history[0].nbytes > 0  # one copy of the state, no more
    train(a, 1)
    a.manager.save(2)
    # Hold step 2's background write 0.5 s longer: the next save must wait for it, and say so.
    pending = a.manager._pending
    assert pending is not None
    slow: Future[Any] = Future()
    inner = pending.future
    threading.Thread(target=lambda: (inner.result(), threading.Event().wait(0.5), slow.set_result(None))).start()
    pending.future = slow
    expected = full_state(a)
    train(a, 1)
    a.manager.save(3)
    a.manager.wait()
    assert stager.buffer_ptrs() == first and a.manager._stager is stager  # the same buffers refilled, none added
    assert stager.allocations == len(first) > 0
    assert [r["step"] for r in records] == [1, 2, 3]
    by_step = {r["step"]: r for r in records}
    assert by_step[2]["checkpoint/waited_s"] >= 0.25 and by_step[2]["checkpoint/blocked_s"] >= 0.25
    assert "waited" in caplog.text and "step 2" in caplog.text
    for rec, saved in zip(records, a.manager.history, strict=True):
        assert rec["checkpoint/bytes"] == saved.nbytes and rec["checkpoint/async"] is True
        assert rec["checkpoint/seconds"] == saved.total_s and rec["checkpoint/seconds"] > 0
        assert rec["checkpoint/mb_per_s"] == pytest.approx(saved.nbytes / 2**20 / rec["checkpoint/seconds"])
        assert rec["checkpoint/blocked_s"] <= rec["checkpoint/seconds"]
    a.manager.close()
    assert a.manager.staged_nbytes == 0
    # Step 2 was written from the reused buffers while training went on: it holds step 2's state exactly.
    b = make_run(tmp_path, [f"--checkpoint.load_path={tmp_path / 'checkpoints' / 'step_2'}"])
    b.manager.restore()
    assert b.state.step == 2
    assert_same(full_state(b), expected)


@pytest.fixture
def torch_211_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's DefaultStager: it closes its StateDictStager after every stage (2.13 no longer does),
    which clears the storage cache and the copy dispatch table that a reused stager depends on."""
    from torch.distributed.checkpoint.staging import DefaultStager

    original = DefaultStager._stage

    def stage_then_close(self: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        out = original(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return out

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)


def test_async_saves_every_two_steps_resume_bit_exact_with_torch_211_staging(
    tmp_path: Path, torch_211_staging: None
) -> None:
    a = make_run(tmp_path, ["--checkpoint.async_mode=async"])
    a.manager.restore()
    expected: dict[int, dict[str, Any]] = {}
    for step in (2, 4, 6):
        train(a, 2)
        a.manager.save(step)  # the second and third reuse the first save's buffers
        expected[step] = full_state(a)
    a.manager.wait()
    later = train(a, 3)
    a.manager.close()
    for step in (4, 6):  # every async save holds its own step's state, bit for bit
        b = make_run(tmp_path, [f"--checkpoint.load_path={tmp_path / 'checkpoints' / f'step_{step}'}"])
        b.manager.restore()
        assert b.state.step == step
        assert_same(full_state(b), expected[step])
    c = make_run(tmp_path, ["--checkpoint.resume=require"])
    assert c.manager.restore().step == 6  # type: ignore[union-attr]
    assert train(c, 3) == later  # the resumed run continues with the same losses
