"""The GPT-2 family trains exactly like one process under FSDP, TP (with and without sequence
parallelism) and FSDP + activation checkpointing: what a new family gets through the
interface (engine/families/base.py), with no line of parallel code of its own.

One 2-rank gloo launch runs every case (tests.helpers.ranks); each case's 10 losses must equal a
single-process run of the same global batch within 1e-5 relative (fp32).
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_close_losses, completed, launch, reference

pytestmark = pytest.mark.distributed

REL = 1e-5
GPT2 = ["--model.family=gpt2", "--model.norm=layernorm", "--model.activation=gelu", "--model.n_kv_heads=4"]

# case -> (distributed settings, reference settings: the same global batch on one process)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "gpt2_fsdp": ([*GPT2], [*GPT2, "--train.batch_size=4"]),
    "gpt2_fsdp_ac_full": ([*GPT2, "--train.activation_checkpointing=full"], [*GPT2, "--train.batch_size=4"]),
    "gpt2_tp": ([*GPT2, "--distributed.tp=2"], [*GPT2]),
    "gpt2_tp_no_sp": ([*GPT2, "--distributed.tp=2", "--distributed.sequence_parallel=false"], [*GPT2]),
}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return launch(2, {k: v[0] for k, v in CASES.items()}, tmp_path_factory.mktemp("gpt2"))


@pytest.mark.parametrize("name", list(CASES))
def test_gpt2_two_ranks_match_one_process(two: dict[str, list[dict]], name: str) -> None:
    ranks = completed(two[name], name)
    ref = reference(tuple(CASES[name][1]))
    for rank, r in enumerate(ranks):
        assert_close_losses(r["losses"], ref["losses"], REL, f"{name} rank {rank}")
