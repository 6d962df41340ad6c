"""The plan and the rules under context parallelism: activation savings, K/V traffic, divisibility."""

from __future__ import annotations

from kforge_cli.engine.plan.planner import build_plan
from kforge_cli.settings import load_settings, resolve_dims
from kforge_cli.settings.rules import world_size_issues


def test_long_context_profile_fits_with_cp4_and_its_sequence_does_not_at_cp1() -> None:
    s = load_settings("h100x8-32k-cp").settings
    plan = build_plan(s, 8)
    assert plan.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 4, "tp": 1}
    assert plan.fits
    assert plan.local_params == s.model.param_count() // 8  # FSDP2 shards over dp_shard x cp = 8 ranks
    assert any("context parallel cp=4" in n and "all-gathers K/V" in n for n in plan.notes)
    assert plan.item("CP K/V gradients").bytes == 2 * 32768 * 8 * 128 * 2  # K and V, 8 kv heads x 128, bf16
    one = build_plan(load_settings("h100x8-32k-cp", overrides=["--distributed.cp=1"]).settings, 8)
    two = build_plan(load_settings("h100x8-32k-cp", overrides=["--distributed.cp=2"]).settings, 8)
    assert not one.fits
    # Activations shrink with the local tokens; only the gathered K/V (and the head's chunk) do not.
    ratio = two.item("activations").bytes / one.item("activations").bytes
    assert 0.5 < ratio < 0.6, ratio
    assert plan.item("activations").bytes < 0.35 * one.item("activations").bytes


def test_cp_rules_name_seq_len_and_accept_tp_and_pp() -> None:
    s = load_settings("cpu-debug", overrides=["--distributed.cp=2", "--train.seq_len=254"]).settings
    issues = {i.path: i.message for i in world_size_issues(s, 2)}
    assert "2 * distributed.cp = 4" in issues["train.seq_len"]
    for composed in (["--distributed.tp=2"], ["--distributed.pp=2", "--train.grad_accum_steps=2"]):
        s = load_settings("cpu-debug", overrides=["--distributed.cp=2", *composed]).settings
        assert not world_size_issues(s, 4), composed
    # Sequence parallelism splits each CP rank's seq_len / cp tokens again over tp: 36 / 2 = 18, not / 4.
    s = load_settings("cpu-debug", overrides=["--distributed.cp=2", "--distributed.tp=4", "--train.seq_len=36"])
    issues = {i.path: i.message for i in world_size_issues(s.settings, 8)}
    assert "18 tokens per CP rank are not divisible by distributed.tp (4)" in issues["train.seq_len"]
    s = load_settings("cpu-debug", overrides=["--distributed.cp=2"]).settings
    assert not world_size_issues(s, 4)
    dims = resolve_dims(s, 4)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.world_size) == (2, 2, 2, 4)  # cp ranks are not data-parallel


def test_hsdp_with_cp_shards_over_dp_shard_x_cp_and_replicates_over_dp_replicate() -> None:
    s = load_settings(
        "h100x8-32k-cp", overrides=["--distributed.cp=2", "--distributed.dp_replicate=2", "--distributed.dp_shard=2"]
    ).settings
    plan = build_plan(s, 8, rank=5)
    assert plan.mesh == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 1}
    assert plan.coordinates == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 1, "tp": 0}
    assert plan.local_params == s.model.param_count() // 4  # sharded 4 ways, replicated twice


def test_plan_counts_cp_traffic_and_buffers_of_the_local_shard_under_tp_and_pp() -> None:
    """CP x TP: K/V of the TP rank's own heads; CP x PP: the layers of this rank's stage; both: the
    TP/PP activation buffers hold seq_len / cp tokens."""
    gib, mib, tokens, dim = 2**30, 2**20, 32768 // 2, 4096  # cp=2: 16k local tokens of the 8B's 32k, bf16
    cp2 = load_settings("h100x8-32k-cp", overrides=["--distributed.cp=2"]).settings
    tp = build_plan(load_settings("h100x8-32k-cp", overrides=["--distributed.cp=2", "--distributed.tp=2"]).settings, 8)
    assert tp.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert tp.item("CP K/V gradients").bytes == 2 * 32768 * 4 * 128 * 2  # 4 of the 8 KV heads per TP rank
    assert tp.item("TP/PP buffers").bytes == tokens * dim * 2
    note = next(n for n in tp.notes if "context parallel" in n)
    assert "all-gathers K/V of its 4 KV heads (64.0 MiB gathered, 32.0 MiB from peers)" in note
    assert "2.00 GiB in and out per rank per micro-batch over its 32 layers" in note
    # TP splits what CP leaves per rank (heads, MLP, with SP the stream), not the row-parallel outputs
    # op-level AC keeps at full width: 0.82 of cp=2 alone.
    assert tp.item("activations").bytes < 0.85 * build_plan(cp2, 4).item("activations").bytes
    pp_overrides = ["--distributed.cp=2", "--distributed.pp=2", "--train.grad_accum_steps=8"]
    pp = build_plan(load_settings("h100x8-32k-cp", overrides=pp_overrides).settings, 8)
    assert pp.item("TP/PP buffers").bytes == 2 * tokens * dim * 2  # send + receive of one stage
    note = next(n for n in pp.notes if "context parallel" in n)
    assert f"{2 * 16 * 128 * mib * 0.5 / gib:.2f} GiB in and out per rank per micro-batch over its 16 layers" in note


def test_ring_attention_is_validated_and_planned_without_gathered_kv_activations() -> None:
    ring = ["--distributed.cp=2", "--distributed.cp_attention=ring"]
    bad = load_settings("cpu-debug", overrides=[*ring, "--data.document_masking=true"]).settings
    messages = [i.message for i in world_size_issues(bad, 2) if i.path == "distributed.cp_attention"]
    assert any("plain causal attention only" in m for m in messages)
    assert any("need CUDA" in m for m in messages)  # cpu-debug trains on the CPU
    flex = load_settings("cpu-debug", overrides=[*ring, "--train.device=cuda", "--model.attention=flex"]).settings
    assert any("runs SDPA" in i.message for i in world_size_issues(flex, 2))
    plain = ["--distributed.cp=2", "--data.document_masking=false", "--train.activation_checkpointing=none"]
    allgather = build_plan(load_settings("h100x8-32k-cp", overrides=plain).settings, 8)
    ringed = build_plan(
        load_settings("h100x8-32k-cp", overrides=[*plain, "--distributed.cp_attention=ring"]).settings, 8
    )
    assert not world_size_issues(load_settings("h100x8-32k-cp", overrides=[*plain, *ring[1:]]).settings, 8)
    # K/V repeated to the 32 query heads (of 8 KV heads): 4x the all-gathered K/V of one layer.
    assert ringed.item("CP K/V gradients").bytes == 4 * allgather.item("CP K/V gradients").bytes
    assert any("ring SDPA" in n and "32 query heads" in n for n in ringed.notes)
    # Saved per layer (no AC): local K/V at query width (2 x 16k x 4096) instead of gathered (2 x 32k x 1024).
    per_layer = (2 * 16384 * 4096 - 2 * 32768 * 1024) * 2
    assert ringed.item("activations").bytes - allgather.item("activations").bytes == 32 * per_layer
