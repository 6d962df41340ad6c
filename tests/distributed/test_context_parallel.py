"""Context parallelism: a sequence split over CP ranks computes what one process computes.

Training: one 2-rank launch runs cp=2 (dp=1) with and without document masking (with
evaluation) and resumes the first run from its step-5 checkpoint at cp=2 (bit for bit)
and, in this process, at cp=1; one 4-rank launch runs cp=2 composed with FSDP dp_shard=2,
with TP=2 (with and without sequence parallelism) and with PP=2. Every run's 10 losses equal a single
process's on the same global batch within 1e-5 relative, and tokens_seen is not scaled by cp.

The model-level check: 2 gloo ranks, each holding a load-balanced half of every sequence
(head + tail chunk) and gathering K/V per layer, give the single-process loss sum and, summed
over the ranks, the single-process gradients, with and without document masking (documents
that straddle the shard boundaries).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.model.sequence_shard import SequenceShard
from kforge_cli.engine.observe import read_metrics
from kforge_cli.engine.parallel.context_parallel import shard_batch
from kforge_cli.settings.training import ModelSettings
from tests.distributed.parity import TINY, assert_close_losses, completed, launch, reference
from tests.distributed.test_parallel_parity import MOE_TP
from tests.helpers.launch import run_ranks
from tests.helpers.ranks import train, train_cases

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

VOCAB, T = 64, 32
REL = 1e-5
CP2 = ["--distributed.cp=2"]
DOCS_EVAL = ["--data.document_masking=true", "--eval.interval=5", "--eval.steps=2"]
CKPT = ["--checkpoint.interval=5", "--checkpoint.keep_last_n=0"]


def _batch(documents: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, T + 1), generator=g)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
    if documents:  # boundaries inside chunks and across the rank split (chunks of 8: 0-7, 8-15, ...)
        docs = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 27 + [1] * 5])
        starts = torch.ones_like(docs, dtype=torch.bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        pos = torch.zeros_like(docs)
        for b in range(2):
            for t in range(1, T):
                pos[b, t] = 0 if starts[b, t] else pos[b, t - 1] + 1
        batch["doc_ids"], batch["positions"] = docs, pos
        batch["labels"][:, :-1][starts[:, 1:]] = -100  # no label across a boundary
    return batch


def _loss_sum(model: Transformer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    kwargs = {k: batch[k] for k in ("doc_ids", "positions") if k in batch}
    logits = model(batch["input_ids"], **kwargs)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")


def model_level(name: str, args: list[str], out_dir: Path) -> dict[str, str]:
    """A case of the 2-rank launch (tests.helpers.ranks): the checks run on every rank."""
    del name, args, out_dir
    rank, world = dist.get_rank(), dist.get_world_size()
    for documents in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelSettings(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB))
        batch = _batch(documents)
        ref = _loss_sum(model, batch)
        ref.backward()
        ref_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        model.sequence_shard = SequenceShard(dist.group.WORLD, world, rank)
        local = _loss_sum(model, shard_batch(batch, rank, world))
        local.backward()
        total = local.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref.detach(), rtol=1e-6, atol=1e-4)
        assert (local.detach() - ref.detach()).abs() > 1.0  # each rank holds only a part of the loss
        for p, want in zip(model.parameters(), ref_grads, strict=True):
            grad = p.grad.clone()  # type: ignore[union-attr]
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
        # FlexAttention (what `auto` picks on CUDA for a CP shard): its block mask maps local
        # queries and gathered keys to global positions; forward only (no CPU backward).
        model.cfg = model.cfg.model_copy(update={"attention": "flex"})
        with torch.no_grad():
            flex = _loss_sum(model, shard_batch(batch, rank, world))
        torch.testing.assert_close(flex, local.detach(), rtol=1e-5, atol=1e-4)
    return {"status": "completed"}


def test_cp2_loss_and_gradients_equal_one_process_with_and_without_documents(
    two_ranks: tuple[dict[str, list[dict]], str],
) -> None:
    res, _ = two_ranks
    completed(res["cp2_model_level"], "cp2_model_level")


def test_shard_batch_gives_each_rank_a_head_and_a_tail_chunk() -> None:
    batch = {"input_ids": torch.arange(16).view(1, 16), "labels": torch.arange(16).view(1, 16) + 100}
    parts = [shard_batch(batch, r, 2) for r in range(2)]
    assert parts[0]["input_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert parts[1]["labels"].tolist() == [[104, 105, 106, 107, 108, 109, 110, 111]]
    assert parts[1]["positions"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]  # global RoPE positions
    assert shard_batch(batch, 0, 1) is batch
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 6"):
        shard_batch(batch, 0, 3)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], str]:
    out = tmp_path_factory.mktemp("cp2")
    step5 = str(out / "cp2" / "checkpoints" / "step_5")
    cases = {
        "cp2": [*CP2, *CKPT],
        "cp2_docs_eval": [*CP2, *DOCS_EVAL],
        "cp2_resume": [*CP2, f"--checkpoint.load_path={step5}"],
        "cp2_moe_docs": [*CP2, *MOE_TP, *DOCS],
    }
    model_check = {"name": "cp2_model_level", "fn": f"{__name__}:model_level", "args": []}  # first: a fresh process
    return run_ranks(2, [model_check, *train_cases(cases, base=TINY)], out), step5


def test_cp2_trains_like_one_process_on_the_same_batch(two_ranks: tuple[dict[str, list[dict]], str]) -> None:
    res, _ = two_ranks
    want = reference(())["losses"]
    for r in completed(res["cp2"], "cp2"):
        assert_close_losses(r["losses"], want, REL, "cp=2 vs one process")
    assert res["cp2"][0]["losses"] == res["cp2"][1]["losses"]  # the global loss, on every rank
    ref_docs = reference(tuple(DOCS_EVAL))
    for r in completed(res["cp2_docs_eval"], "cp2_docs_eval"):
        assert_close_losses(r["losses"], ref_docs["losses"], REL, "cp=2 + document masking vs one process")
        assert r["eval_loss"] == pytest.approx(ref_docs["eval_loss"], rel=REL)
    # FSDP2 shards over dp_shard x cp: each CP rank holds half of the parameters.
    full = res["cp2"][0]["full_param_numel"]
    assert sum(r["local_param_numel"] for r in res["cp2"]) == full
    # tokens_seen counts each token once (not once per CP rank): 10 steps x 2 sequences x 32 tokens.
    records = read_metrics(Path(two_ranks[1]).parents[2] / "cp2" / "metrics.jsonl")
    assert [r["tokens_seen"] for r in records if "loss" in r][-1] == 10 * 2 * 32


def test_moe_with_cp2_trains_like_one_process(two_ranks: tuple[dict[str, list[dict]], str]) -> None:
    """MoE (shared expert, aux-loss-free bias, strong aux and z losses, two micro-batches) with
    document masking at cp=2: losses and pre-clip gradient norms equal one process's within 1e-5
    (the router's aux-loss gradient is weighted per whole sequence, the expert load all-reduced
    over the CP group)."""
    res, _ = two_ranks
    ref = reference((*MOE_TP, *DOCS))
    for r in completed(res["cp2_moe_docs"], "cp2_moe_docs"):
        assert_close_losses(r["losses"], ref["losses"], REL, "MoE cp=2 vs one process")
        assert_close_losses(r["grad_norms"], ref["grad_norms"], REL, "MoE cp=2 grad norm vs one process")


def test_cp2_resume_is_bit_exact_and_a_cp2_checkpoint_resumes_at_cp1(
    two_ranks: tuple[dict[str, list[dict]], str], tmp_path: Path
) -> None:
    res, step5 = two_ranks
    uninterrupted = completed(res["cp2"], "cp2")[0]["losses"]
    for r in completed(res["cp2_resume"], "cp2_resume"):
        assert r["losses"] == uninterrupted[5:]  # steps 6..10, bit for bit
    one = train("cp1_resume", [*TINY, f"--checkpoint.load_path={step5}"], tmp_path)
    assert one["status"] == "completed" and len(one["losses"]) == 5
    for got, want in zip(one["losses"], uninterrupted[5:], strict=True):
        assert got == pytest.approx(want, rel=REL, abs=0)


PP2 = ["--distributed.pp=2", "--train.grad_accum_steps=2"]
DOCS = ["--data.document_masking=true"]
# One 4-rank launch: case -> (cp settings, the one-process reference with the same global batch).
FOUR_RANKS: dict[str, tuple[list[str], list[str]]] = {
    "cp2_fsdp2_docs": ([*CP2, *DOCS], ["--train.batch_size=4", *DOCS]),
    # TP with sequence parallelism and QK-norm: each CP rank's T/2 tokens split again over tp.
    "cp2_tp2_sp_docs_eval": (
        [*CP2, "--distributed.tp=2", "--model.qk_norm=true", *DOCS_EVAL],
        ["--model.qk_norm=true", *DOCS_EVAL],
    ),
    # TP without SP and without the vocab-parallel loss: replicated stream, gathered logits.
    "cp2_tp2_no_sp": (
        [*CP2, "--distributed.tp=2", "--distributed.sequence_parallel=false", "--distributed.loss_parallel=false"],
        [],
    ),
    "cp2_pp2_docs_eval": ([*CP2, *PP2, *DOCS_EVAL], [*PP2[1:], *DOCS_EVAL]),
    # MoE inside pipeline stages at cp=2: the aux-loss gradient fed per micro-batch within the schedule.
    "cp2_pp2_moe_docs": ([*CP2, "--distributed.pp=2", *MOE_TP, *DOCS], [*MOE_TP, *DOCS]),
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], Path]:
    out = tmp_path_factory.mktemp("cp4")
    return launch(4, {name: case[0] for name, case in FOUR_RANKS.items()}, out), out


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_cp2_composed_on_four_ranks_trains_like_one_process(
    four_ranks: tuple[dict[str, list[dict]], Path], name: str
) -> None:
    """cp=2 x FSDP dp_shard=2, cp=2 x TP=2 (+SP) and cp=2 x PP=2 on 4 ranks equal one process:
    per-step losses (every rank), eval loss, and tokens_seen (each token counted once)."""
    res, out = four_ranks
    ref = reference(tuple(FOUR_RANKS[name][1]))
    results = completed(res[name], name)
    for r in results:
        assert_close_losses(r["losses"], ref["losses"], REL, f"{name} vs one process")
        if ref["eval_loss"] is not None:
            assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=REL)
        if "moe" in name:
            assert_close_losses(r["grad_norms"], ref["grad_norms"], REL, f"{name} grad norm vs one process")
    steps = [r for r in read_metrics(out / name / "metrics.jsonl") if "loss" in r]
    batch = 4 if name == "cp2_fsdp2_docs" else 2 * (2 if "pp2" in name else 1)  # sequences per step
    assert steps[-1]["tokens_seen"] == 10 * batch * 32
    for r in steps:  # tokens/s: the step's global tokens over its time (log_interval 1), not x cp
        assert r["tokens_per_sec"] * r["step_time_s"] == pytest.approx(batch * 32, rel=1e-6)
    if name == "cp2_fsdp2_docs":  # FSDP shards over dp_shard x cp = 4 ranks
        assert sum(r["local_param_numel"] for r in results) == results[0]["full_param_numel"]


CUDA = ["--train.device=cuda", "--train.mixed_precision=fp32"]
TWO_GPUS: dict[str, tuple[list[str], list[str]]] = {
    # `auto` runs FlexAttention for the CP shard on CUDA (local queries x gathered keys).
    "cp2_flex_docs": ([*CUDA, *CP2, *DOCS], [*CUDA, *DOCS]),
    # torch's ring SDPA (fp32: the memory-efficient kernel), plain causal, GQA heads repeated.
    "cp2_ring": ([*CUDA, *CP2, "--distributed.cp_attention=ring"], CUDA),
}


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    return launch(2, {name: case[0] for name, case in TWO_GPUS.items()}, tmp_path_factory.mktemp("cp2cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TWO_GPUS))
def test_cp2_on_nccl_trains_like_one_gpu(two_gpus: dict[str, list[dict]], name: str) -> None:
    want = reference(tuple(TWO_GPUS[name][1]))["losses"]
    for r in completed(two_gpus[name], name):
        assert_close_losses(r["losses"], want, 1e-4, f"{name} (nccl) vs one GPU")
