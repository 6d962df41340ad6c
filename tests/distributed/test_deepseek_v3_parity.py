"""DeepSeek-V3 (latent attention, sigmoid group-limited MoE, multi-token prediction) trains like one
process under FSDP (with full activation checkpointing too), TP with and without SP, PP, CP and EP=2: one 2-rank gloo launch, 10 fp32 steps per case.

Losses (and, where a router or MTP gradient could be scaled wrongly without the loss showing it,
grad norms) within 1e-5 relative of a single process on the same global batch. MTP runs in the
FSDP, TP and EP cases; pipeline and context parallelism refuse it (``model.mtp_depth``), so those
cases train the same model without it.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_close_losses, completed, launch, reference

pytestmark = pytest.mark.distributed

REL = 1e-5
DSV3 = [
    "--model.family=deepseek_v3",
    "--model.n_kv_heads=4",
    "--model.ffn_hidden_dim=64",
    "--model.mla.kv_lora_rank=16",
    "--model.mla.q_lora_rank=24",
    "--model.mla.qk_rope_head_dim=8",
    "--model.mla.qk_nope_head_dim=8",
    "--model.mla.v_head_dim=8",
    "--model.moe.num_experts=4",
    "--model.moe.top_k=2",
    "--model.moe.expert_hidden_dim=32",
    "--model.moe.num_shared_experts=1",
    "--model.moe.first_dense_layers=1",
    "--model.moe.score_func=sigmoid",
    "--model.moe.n_groups=2",
    "--model.moe.topk_groups=1",
    "--model.moe.route_scale=2.5",
    "--model.moe.bias_update_rate=0.01",
    "--model.moe.aux_loss_weight=0.01",
    "--train.seed=7",
]
MTP = [*DSV3, "--model.mtp_depth=1", "--model.mtp_loss_weight=0.3"]
NO_MTP = [*DSV3, "--model.mtp_depth=0"]
CASES: dict[str, tuple[list[str], list[str]]] = {
    "dsv3_fsdp": (MTP, [*MTP, "--train.batch_size=4"]),
    "dsv3_tp": ([*MTP, "--distributed.tp=2"], MTP),
    "dsv3_tp_no_sp": (
        [*MTP, "--distributed.tp=2", "--distributed.sequence_parallel=false", "--distributed.loss_parallel=false"],
        MTP,
    ),
    "dsv3_fsdp_ac_full": ([*MTP, "--train.activation_checkpointing=full"], [*MTP, "--train.batch_size=4"]),
    "dsv3_pp": ([*NO_MTP, "--distributed.pp=2", "--train.grad_accum_steps=2"], [*NO_MTP, "--train.grad_accum_steps=2"]),
    "dsv3_cp": ([*NO_MTP, "--distributed.cp=2"], NO_MTP),
    "dsv3_ep2": ([*MTP, "--distributed.ep=2"], [*MTP, "--train.batch_size=4"]),
}
GRAD_NORM_CASES = ("dsv3_fsdp", "dsv3_tp", "dsv3_tp_no_sp", "dsv3_fsdp_ac_full", "dsv3_ep2")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return launch(2, {k: v[0] for k, v in CASES.items()}, tmp_path_factory.mktemp("dsv3"))


@pytest.mark.parametrize("name", list(CASES))
def test_deepseek_v3_two_ranks_match_one_process(two: dict[str, list[dict]], name: str) -> None:
    ranks = completed(two[name], name)
    ref = reference(tuple(CASES[name][1]))
    worst = 0.0
    for rank, r in enumerate(ranks):
        assert_close_losses(r["losses"], ref["losses"], REL, f"{name} rank {rank}")
        worst = max(worst, *(abs(g - w) / abs(w) for g, w in zip(r["losses"], ref["losses"], strict=True)))
        if name in GRAD_NORM_CASES:
            assert_close_losses(r["grad_norms"], ref["grad_norms"], REL, f"{name} grad norm rank {rank}")
    print(f"{name}: max rel loss diff over 10 steps {worst:.2e}")
