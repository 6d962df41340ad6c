"""Distributed Muon (Newton-Schulz split over the ranks) equals single-process Muon.

ONE 4-process gloo launch (tests/distributed/muon_driver.py) runs every case:

- optimizer cases: 20 Muon steps with seeded gradients on a tiny Transformer sharded by
  kforge's FSDP2 / TP functions; the gathered parameters after every step must equal an
  unsharded copy's within 1e-5 (fp32), and the old gather-everywhere path's exactly. 2-rank
  cases run as two independent halves of the world (a ``pp`` mesh dim of 2).
- train cases: ``run_training`` with Muon for 20 steps, losses within 1e-5 (relative) of one
  process on the same global batch.

The Newton-Schulz FLOPs each rank ran (``Muon.ns_flops_last_step``) must add up, over the
ranks of a mesh, to one process's, with no rank above 1.05x an even share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.parity import TINY, completed, reference
from tests.helpers.launch import run_ranks
from tests.helpers.ranks import train_cases

pytestmark = pytest.mark.distributed

TOL = 1e-5  # fp32
STEPS = 20
NPROC = 4


def _dims(pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, cp: int = 1) -> dict[str, int]:
    return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "cp": cp}


# name -> (spec, ranks per mesh); pp=2: the two halves of the world are independent 2-rank jobs
OPTIMIZER: dict[str, tuple[dict[str, Any], int]] = {
    "opt_fsdp2": ({"dims": _dims(pp=2, dp_shard=2)}, 2),
    "opt_tp2": ({"dims": _dims(pp=2, tp=2)}, 2),
    "opt_fsdp4": ({"dims": _dims(dp_shard=4)}, 4),
    "opt_fsdp2_tp2": ({"dims": _dims(dp_shard=2, tp=2)}, 4),
    # FSDP over the flattened dp_shard x cp dim, then TP: the mesh flattened again for the exchange
    "opt_cp2_tp2": ({"dims": _dims(cp=2, tp=2)}, 4),
    # one matrix per owner per exchange: 7 rounds of all-to-alls instead of one
    "opt_fsdp2_tp2_rounds": ({"dims": _dims(dp_shard=2, tp=2), "round_bytes": 1}, 4),
    # replicated blocks (each sent once to an owner, results to both replicas), plain momentum
    "opt_hsdp2x2_no_nesterov": (
        {"dims": _dims(dp_replicate=2, dp_shard=2), "overrides": ["--optimizer.muon_nesterov=false"]},
        4,
    ),
    # 5, 3, 10 and 1 rows over 4 ranks: uneven and empty shards
    "opt_fsdp4_uneven": ({"dims": _dims(dp_shard=4), "model": "uneven"}, 4),
}
BALANCED = tuple(n for n, (spec, _) in OPTIMIZER.items() if spec.get("model") != "uneven")

MUON = ["--optimizer.name=muon", f"--train.max_steps={STEPS}"]
PP = ["--distributed.pp=2", "--train.grad_accum_steps=2"]
# name -> (settings on 4 ranks, single-process settings with the same global batch)
TRAIN: dict[str, tuple[list[str], list[str]]] = {
    "train_fsdp4": (["--train.batch_size=1"], ["--train.batch_size=4"]),
    "train_fsdp2_tp2": (["--distributed.tp=2"], ["--train.batch_size=4"]),
    # each stage's matrices split over its 2 data-parallel ranks
    "train_pp2_fsdp2": (PP, ["--train.batch_size=4", *PP[1:]]),
}


def _launch(out_dir: Path) -> dict[str, list[dict[str, Any]]]:
    cases: list[dict[str, Any]] = [
        {"name": n, "fn": "tests.distributed.muon_driver:optimizer_case", "args": spec}
        for n, (spec, _) in OPTIMIZER.items()
    ]
    cases += train_cases({n: o for n, (o, _) in TRAIN.items()}, base=[*TINY, *MUON])
    return run_ranks(NPROC, cases, out_dir, timeout=900)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _launch(tmp_path_factory.mktemp("muon"))


@pytest.mark.parametrize("name", list(OPTIMIZER))
def test_split_muon_equals_one_process_and_the_gathered_path(four: dict[str, list[dict]], name: str) -> None:
    for rank, r in enumerate(completed(four[name], name)):
        assert r["moved"] > 0.05, (name, r["moved"])  # 20 steps at muon_lr 0.02 moved the weights
        assert r["max_diff"] <= TOL, f"{name} rank {rank}: {r['max_diff']} from one process"
        assert r["max_diff_vs_gathered"] == 0.0, f"{name} rank {rank}: {r['max_diff_vs_gathered']} from gathering"


@pytest.mark.parametrize("name", list(OPTIMIZER))
def test_each_rank_runs_its_share_of_newton_schulz(four: dict[str, list[dict]], name: str) -> None:
    ranks = completed(four[name], name)
    group = OPTIMIZER[name][1]
    total = ranks[0]["ns_flops_one_process"]
    assert len(total) == STEPS and total[0] > 0 and all(t == total[0] for t in total)
    for start in range(0, NPROC, group):  # each mesh (a half of the world when group == 2)
        shares = [ranks[r]["ns_flops"][-1] for r in range(start, start + group)]
        assert sum(shares) == total[0], (name, shares, total[0])
        if name in BALANCED:
            assert max(shares) <= 1.05 * total[0] / group, (name, shares)
    for r in ranks:
        assert len(set(r["ns_flops"])) == 1  # every step the same split


@pytest.mark.parametrize("name", list(TRAIN))
def test_training_with_split_muon_equals_one_process(four: dict[str, list[dict]], name: str) -> None:
    want = reference(tuple([*MUON, *TRAIN[name][1]]))["losses"]
    assert len(want) == STEPS
    for rank, r in enumerate(completed(four[name], name)):
        assert len(r["losses"]) == STEPS
        for step, (g, w) in enumerate(zip(r["losses"], want, strict=True), start=1):
            assert abs(g - w) <= TOL * abs(w), f"{name} rank {rank} step {step}: loss {g!r} vs one process {w!r}"
