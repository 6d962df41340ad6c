"""Mixtures: weights, temperature, phases by optimizer step, and exact resume of a mixture."""

from __future__ import annotations

import math
from itertools import islice

import numpy as np
import pytest

from kforge_cli.engine.data.loader import BatchFetcher, StatefulLoader
from kforge_cli.engine.data.mixture import MixtureSchedule
from kforge_cli.engine.data.sampler import Cursor, SampleOrder
from kforge_cli.engine.data.tokens import ArrayTokens, Windows
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.data import DataPhase

NAMES = ["web", "books"]


def _order(schedule: MixtureSchedule, *, sizes=(100, 60), batch=8, rank=0, dp=1, accum=1) -> SampleOrder:
    return SampleOrder(
        NAMES, list(sizes), schedule, seed=5, batch_size=batch, dp_rank=rank, dp_size=dp, grad_accum_steps=accum
    )


def _draws(order: SampleOrder, batches: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    cursor, ds, win = Cursor.start(2), [], []
    for _ in range(batches):
        plan = order.next_batch(cursor)
        cursor = plan.after
        ds.append(plan.dataset_ids)
        win.append(plan.windows)
    return ds, win


def test_weights_3_to_1_draw_within_2_percent_over_4000_samples_on_2_ranks() -> None:
    sched = MixtureSchedule.build(NAMES, [3.0, 1.0], temperature=1.0)
    ids = np.concatenate([d for r in range(2) for d in _draws(_order(sched, rank=r, dp=2), 250)[0]])
    assert len(ids) == 4000
    share = float(np.mean(ids == 0))
    assert abs(share - 0.75) < 0.02, share
    # each rank's own share is balanced too (the draws are low-discrepancy, not i.i.d.)
    for r in range(2):
        mine = np.concatenate(_draws(_order(sched, rank=r, dp=2), 250)[0])
        assert abs(float(np.mean(mine == 0)) - 0.75) < 0.02


def test_temperature_flattens_the_mixture() -> None:
    sched = MixtureSchedule.build(NAMES, [3.0, 1.0], temperature=2.0)
    expected = math.sqrt(3) / (math.sqrt(3) + 1)
    assert sched.weights_at(0)["web"] == pytest.approx(expected, abs=1e-12)
    ids = np.concatenate(_draws(_order(sched), 500)[0])
    assert abs(float(np.mean(ids == 0)) - expected) < 0.02


def test_each_dataset_cycles_through_all_its_windows_without_repeats() -> None:
    sched = MixtureSchedule.build(NAMES, [1.0, 1.0], temperature=1.0)
    ds, win = _draws(_order(sched, sizes=(40, 24)), 20)
    ids, windows = np.concatenate(ds), np.concatenate(win)
    for d, n in enumerate((40, 24)):
        mine = windows[ids == d][:n].tolist()
        assert sorted(mine) == list(range(n))


def test_phase_switches_weights_at_its_start_step_counting_accumulation() -> None:
    phases = [DataPhase(start_step=5, dataset_weights={"books": 1.0}, lr_scale=0.5), DataPhase(start_step=8)]
    sched = MixtureSchedule.build(NAMES, [3.0, 1.0], temperature=1.0, phases=phases)
    assert sched.weights_at(4) == {"web": 0.75, "books": 0.25}
    assert sched.weights_at(5) == {"web": 0.0, "books": 1.0}
    assert sched.weights_at(9) == {"web": 0.0, "books": 1.0}  # empty dataset_weights keeps the weights
    ds, _ = _draws(_order(sched, accum=2), 20)  # 2 micro-batches per optimizer step
    before, after = np.concatenate(ds[:10]), np.concatenate(ds[10:])
    assert abs(float(np.mean(before == 0)) - 0.75) < 0.05
    assert set(after.tolist()) == {1}


def test_bad_phase_weights_are_reported() -> None:
    with pytest.raises(InvalidInputError, match="unknown dataset"):
        MixtureSchedule.build(NAMES, [1, 1], 1.0, [DataPhase(start_step=1, dataset_weights={"code": 1.0})])
    with pytest.raises(InvalidInputError, match=r"data.phases.0.dataset_weights: at least one dataset"):
        MixtureSchedule.build(NAMES, [1, 1], 1.0, [DataPhase(start_step=1, dataset_weights={"web": 0.0})])


def test_mixture_batches_carry_dataset_ids_and_resume_exactly() -> None:
    streams = [Windows(ArrayTokens(np.arange(801) + 1000 * d), 8) for d in range(2)]
    sched = MixtureSchedule.build(NAMES, [3.0, 1.0], 1.0, [DataPhase(start_step=6, dataset_weights={"books": 1})])

    def loader() -> StatefulLoader:
        order = _order(sched, sizes=(100, 100), batch=4)
        return StatefulLoader(order, BatchFetcher(streams, 9999, False), seq_len=8)

    ref = [b for b in islice(iter(loader()), 10)]
    for b in ref:  # the dataset id says where the tokens came from
        assert ((b["input_ids"][:, 0] // 1000) == b["dataset_ids"]).all()
    first = loader()
    got = list(islice(iter(first), 4))
    second = loader()
    second.load_state_dict(first.state_dict())
    got += list(islice(iter(second), 6))
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(ref, got, strict=True))
    assert second.state_dict()["counts"] == [
        int((np.concatenate([b["dataset_ids"] for b in ref]) == d).sum()) for d in range(2)
    ]


def test_advance_and_group_batch_replay_what_each_rank_reads() -> None:
    """`kforge data-trace` replays a run with `advance` (counts in bulk) and `group_batch` (every rank's
    samples): both equal what the ranks' own `next_batch` calls give, across a phase start."""
    sched = MixtureSchedule.build(
        NAMES, [3.0, 1.0], 1.0, [DataPhase(start_step=3, dataset_weights={"web": 1.0, "books": 2.0})]
    )
    ranks = [_order(sched, batch=3, rank=r, dp=2, accum=2) for r in range(2)]
    cursor = Cursor(1, 6, (4, 2))  # mid-run, mid-step
    for n in range(12):
        assert ranks[0].advance(cursor, 0) == cursor
        group = ranks[0].group_batch(cursor)
        for r, order in enumerate(ranks):
            plan = order.next_batch(cursor)
            assert plan.after == group.after
            assert plan.dataset_ids.tolist() == group.dataset_ids[r * 3 : (r + 1) * 3].tolist()
            assert plan.windows.tolist() == group.windows[r * 3 : (r + 1) * 3].tolist()
        after = ranks[1].advance(Cursor(1, 6, (4, 2)), n + 1)
        cursor = group.after
        assert after == cursor, n
    assert ranks[0].advance(Cursor.start(2), 0) == Cursor.start(2)
