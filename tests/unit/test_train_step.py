"""The plain step: gradient accumulation normalised by valid tokens across micro-batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from kforge_cli.engine.train.session import TrainingSession
from kforge_cli.engine.train.step import plain_step
from tests.helpers.tiny_run import tiny_session, tiny_settings

TINY = ["--train.grad_clip_norm=0"]  # on top of tests.helpers.tiny_run.TINY_MODEL


def make_session(tmp_path: Path, extra: list[str] | None = None, data: Any = None) -> TrainingSession:
    return tiny_session(tmp_path, tiny_settings(*TINY, *(extra or [])), data=data or NoData())


class NoData:
    """The step reads only `dataset_names` of the session's data (a mixture test sets it)."""

    dataset_names: ClassVar[list[str]] = []
    train = None  # nothing for the checkpoint manager to save
    val = None


def make_batch(n: int = 8, t: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (n, t + 1), generator=g)
    labels = tokens[:, 1:].clone()
    for i in range(n):  # a different number of valid label tokens in every sequence
        labels[i, t - 2 * i :] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [0, 24])
def test_four_micro_batches_of_two_equal_one_batch_of_eight(tmp_path: Path, chunk: int) -> None:
    one = make_session(tmp_path, [f"--train.loss_chunk_size={chunk}"])
    four = make_session(tmp_path, [f"--train.loss_chunk_size={chunk}"])
    four.model.load_state_dict(one.model.state_dict())
    batch = make_batch()
    r1 = plain_step(one, [batch]).read()
    r4 = plain_step(four, [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]).read()
    assert r1.valid_tokens == r4.valid_tokens == int((batch["labels"] != -100).sum())
    assert r4.loss == pytest.approx(r1.loss, rel=1e-6)
    g1, g4 = grads(one.model), grads(four.model)
    assert g1.keys() == g4.keys() and len(g1) > 0
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)
    assert r4.grad_norm == pytest.approx(r1.grad_norm, rel=1e-5)
    # and the update after one optimizer step is the same, to what fp32 gradients allow: Adam's first
    # step is lr * g / (|g| + eps), whose slope at |g| ~ eps (1e-8; such elements exist here) is
    # ~lr / (4 eps) ~ 4e3, so a 4e-11 rounding difference of g (a fraction of the 2.3e-10 ulp of the
    # ~2e-3 partial sums g is made of) moves the update by ~2e-7: allow 2e-3 * lr (0.2% of a step).
    one.optimizer.step()
    four.optimizer.step()
    step_atol = 2e-3 * one.optimizer.param_groups[0]["lr"]
    for (n, a), (_, b) in zip(one.model.named_parameters(), four.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=step_atol, msg=n)


def test_per_micro_batch_averaging_would_differ(tmp_path: Path) -> None:
    """Guards the test above: a naive mean of per-micro-batch means gives a different loss."""
    session = make_session(tmp_path)
    batch = make_batch()
    reference = plain_step(session, [batch]).read().loss
    naive = 0.0
    with torch.no_grad():
        for i in range(0, 8, 2):
            labels = batch["labels"][i : i + 2]
            logits = session.model(batch["input_ids"][i : i + 2])
            naive += float(session.loss_fn.from_logits(logits, labels)) / int((labels != -100).sum()) / 4
    assert abs(naive - reference) > 1e-3


def test_grad_norm_is_reported_before_clipping(tmp_path: Path) -> None:
    clipped = make_session(tmp_path, ["--train.grad_clip_norm=0.01"])
    free = make_session(tmp_path)
    free.model.load_state_dict(clipped.model.state_dict())
    batch = make_batch()
    rc, rf = plain_step(clipped, [batch]).read(), plain_step(free, [batch]).read()
    assert rc.grad_norm == pytest.approx(rf.grad_norm, rel=1e-6) and rc.grad_norm > 0.01
    total = torch.sqrt(sum((p.grad**2).sum() for p in clipped.model.parameters() if p.grad is not None))
    assert float(total) == pytest.approx(0.01, rel=1e-3)


def test_per_dataset_losses_are_token_weighted_parts_of_the_total(tmp_path: Path) -> None:
    from types import SimpleNamespace

    session = make_session(tmp_path)
    session.data = SimpleNamespace(dataset_names=["web", "code"])
    batch = make_batch()
    batch["dataset_ids"] = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])
    result = plain_step(session, [batch]).read()
    with torch.no_grad():
        logits = session.model(batch["input_ids"])
        for d, name in enumerate(["web", "code"]):
            rows = batch["dataset_ids"] == d
            labels = batch["labels"][rows]
            expected = float(session.loss_fn.from_logits(logits[rows], labels)) / int((labels != -100).sum())
            assert result.extra[f"loss/{name}"] == pytest.approx(expected, rel=1e-5)
    # gradients equal the untracked path's
    plain = make_session(tmp_path)
    plain.model.load_state_dict(session.model.state_dict())
    reference = plain_step(plain, [{k: v for k, v in batch.items() if k != "dataset_ids"}]).read()
    assert reference.extra == {} and result.loss == pytest.approx(reference.loss, rel=1e-6)
    for (n, a), (_, b) in zip(session.model.named_parameters(), plain.model.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=n)
