"""The sample order and the stateful loader: partition over ranks, exact resume, dp_size changes."""

from __future__ import annotations

import hashlib
import json
from itertools import islice

import numpy as np
import pytest

from kforge_cli.engine.data.loader import BatchFetcher, DataStateError, StatefulLoader
from kforge_cli.engine.data.mixture import MixtureSchedule
from kforge_cli.engine.data.sampler import Cursor, SampleOrder
from kforge_cli.engine.data.tokens import ArrayTokens, Windows

SEQ = 8
EOS = 65535


def _windows(num_windows: int) -> Windows:
    # token t has value t, so the first input of window i is i * SEQ: batches reveal their windows
    return Windows(ArrayTokens(np.arange(num_windows * SEQ + 1, dtype=np.int64)), SEQ)


def _order(num_windows: int, *, batch: int, rank: int = 0, dp: int = 1, seed: int = 1234) -> SampleOrder:
    sched = MixtureSchedule.build(["d"], [1.0], 1.0)
    return SampleOrder(["d"], [num_windows], sched, seed=seed, batch_size=batch, dp_rank=rank, dp_size=dp)


def _loader(num_windows: int, *, batch: int, rank: int = 0, dp: int = 1, workers: int = 0) -> StatefulLoader:
    fetch = BatchFetcher([_windows(num_windows)], EOS, document_masking=False)
    order = _order(num_windows, batch=batch, rank=rank, dp=dp)
    return StatefulLoader(order, fetch, seq_len=SEQ, num_workers=workers, prefetch_factor=2)


def _window_ids(batch: dict) -> list[int]:
    return (batch["input_ids"][:, 0] // SEQ).tolist()


def _digest(batch: dict) -> str:
    h = hashlib.sha256()
    for key in ("input_ids", "labels", "dataset_ids"):
        h.update(batch[key].numpy().tobytes())
    return h.hexdigest()


def _take(loader: StatefulLoader, n: int) -> list[dict]:
    return list(islice(iter(loader), n))


def test_two_ranks_cover_an_epoch_exactly_once() -> None:
    n, batch, dp = 24, 3, 2
    seen = []
    for rank in range(dp):
        order, cursor = _order(n, batch=batch, rank=rank, dp=dp), Cursor.start(1)
        for _ in range(n // (batch * dp)):
            plan = order.next_batch(cursor)
            cursor = plan.after
            seen += plan.windows.tolist()
    assert sorted(seen) == list(range(n))
    assert seen != sorted(seen)  # shuffled, not sequential


@pytest.mark.parametrize("n", [25, 31])
def test_global_stream_is_a_permutation_per_epoch_and_epochs_differ(n: int) -> None:
    # n is not a multiple of batch * dp: the stream still covers each epoch exactly once
    batch, dp = 3, 2
    per_rank = {r: [] for r in range(dp)}
    for rank in range(dp):
        order, cursor = _order(n, batch=batch, rank=rank, dp=dp), Cursor.start(1)
        for _ in range(3 * n // (batch * dp) + 1):
            plan = order.next_batch(cursor)
            cursor = plan.after
            per_rank[rank].append(plan.windows.tolist())
    stream = [w for m in range(len(per_rank[0])) for r in range(dp) for w in per_rank[r][m]]
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    for ep in epochs:
        assert sorted(ep) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]


def test_order_depends_on_seed_only() -> None:
    a = _order(50, batch=5, seed=1).next_batch(Cursor.start(1)).windows.tolist()
    b = _order(50, batch=5, seed=1).next_batch(Cursor.start(1)).windows.tolist()
    c = _order(50, batch=5, seed=2).next_batch(Cursor.start(1)).windows.tolist()
    assert a == b and a != c


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_twice_in_an_epoch_reproduces_uninterrupted_batches(workers: int) -> None:
    n, batch, total = 30, 4, 17  # 7.5 batches per epoch: the run crosses two epoch boundaries
    reference = [_digest(b) for b in _take(_loader(n, batch=batch, workers=workers), total)]

    first = _loader(n, batch=batch, workers=workers)
    got = [_digest(b) for b in _take(first, 3)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state["batch"] == 3 and state["sample"] == 12

    second = _loader(n, batch=batch, workers=workers)
    second.load_state_dict(state)
    got += [_digest(b) for b in _take(second, 2)]  # second resume still inside epoch 0
    state = json.loads(json.dumps(second.state_dict()))

    third = _loader(n, batch=batch, workers=workers)
    third.load_state_dict(state)
    got += [_digest(b) for b in _take(third, total - 5)]
    assert got == reference


def test_resume_with_workers_matches_resume_without() -> None:
    plain, threaded = _loader(40, batch=4), _loader(40, batch=4, workers=2)
    assert [_digest(b) for b in _take(plain, 6)] == [_digest(b) for b in _take(threaded, 6)]
    assert plain.state_dict() == threaded.state_dict()


def test_state_is_identical_on_every_rank_and_resumes_on_fewer_ranks() -> None:
    n, batch, k = 42, 3, 4  # 24 consumed on 2 ranks, 18 = 6 batches left on 1 rank
    ranks = [_loader(n, batch=batch, rank=r, dp=2) for r in range(2)]
    consumed = [w for loader in ranks for b in _take(loader, k) for w in _window_ids(b)]
    states = [loader.state_dict() for loader in ranks]
    assert states[0] == states[1]
    # uninterrupted 2-rank continuation vs one rank with a doubled batch: same global samples
    cont = [_loader(n, batch=batch, rank=r, dp=2) for r in range(2)]
    for loader in cont:
        loader.load_state_dict(states[0])
    two_rank = [_take(loader, 3) for loader in cont]
    single = _loader(n, batch=2 * batch, rank=0, dp=1)
    single.load_state_dict(states[0])
    for m, b in enumerate(_take(single, 3)):
        assert _window_ids(b) == _window_ids(two_rank[0][m]) + _window_ids(two_rank[1][m])
    # with the same batch size on one rank: the epoch is still covered exactly once
    same_batch = _loader(n, batch=batch, rank=0, dp=1)
    same_batch.load_state_dict(states[0])
    rest = [w for b in _take(same_batch, (n - len(consumed)) // batch) for w in _window_ids(b)]
    assert sorted(consumed + rest) == list(range(n))


def test_load_state_refuses_other_data_and_mid_step_accum_change() -> None:
    loader = _loader(40, batch=4)
    _take(loader, 3)
    state = loader.state_dict()
    with pytest.raises(DataStateError, match="dataset_windows"):
        _loader(41, batch=4).load_state_dict(state)
    with pytest.raises(DataStateError, match="data_seed"):
        _loader(40, batch=4).load_state_dict({**state, "data_seed": 7})
    with pytest.raises(DataStateError, match="version"):
        _loader(40, batch=4).load_state_dict({**state, "version": 99})
    with pytest.raises(DataStateError, match="mid-step"):
        _loader(40, batch=4).load_state_dict({**state, "grad_accum_steps": 2})
    resumed = _loader(40, batch=4)
    resumed.load_state_dict({**state, "batch": 4, "grad_accum_steps": 2})  # 2 optimizer steps done
    assert resumed.state_dict()["batch"] == 2  # = 2 steps at grad_accum_steps 1


def test_pin_memory_applies_without_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With num_workers = 0 (no DataLoader to pin) the loader pins each batch itself (on CUDA machines)."""
    import torch

    pinned: list[int] = []

    def fake_pin(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        pinned.append(id(self))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    loader = _loader(40, batch=4)
    loader.pin_memory = True  # what `pin_memory=True` gives when CUDA is available
    batch = _take(loader, 1)[0]
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    assert tensors and len(pinned) == len(tensors)
    unpinned = _loader(40, batch=4)
    _take(unpinned, 1)
    assert len(pinned) == len(tensors)  # off (no CUDA here): nothing pinned
