"""`load_model` and HF warm start across layouts: 2-rank FSDP and pp=2 checkpoints give the same model.

One 2-rank launch (gloo) runs ``saved_case`` per case: it builds
the parallel model (initialised exactly as one process would), optionally warm-starts
it from a Hugging Face directory, saves a checkpoint through the real
``CheckpointManager`` and writes each rank's full view of the weights. The test then
loads every checkpoint with ``load_model`` on one process (no process group) and
requires bit-equality with the single-process model and with what the ranks held.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import tiny
from tests.helpers.launch import run_ranks

TINY = [
    *tiny.TINY_MODEL,
    "--model.n_layers=4",
    "--train.batch_size=2",
    "--train.max_steps=4",
    "--scheduler.warmup_steps=1",
    "--train.seed=11",
]
FSDP = ["--distributed.dp_shard=2"]
PP = ["--distributed.pp=2", "--distributed.dp_shard=1", "--train.grad_accum_steps=2"]


def saved_case(name: str, overrides: list[str], out_dir: Path) -> dict[str, str]:
    """A case of the 2-rank launch (tests.helpers.ranks): one checkpoint, and this rank's full weights
    as a tensors-only file."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from kforge_cli.engine.checkpoint import RunParts
    from kforge_cli.engine.checkpoint.run_position import TrainState
    from kforge_cli.engine.parallel import build_parallel_model
    from kforge_cli.engine.runtime import init_runtime
    from kforge_cli.engine.train.optim.optimizer import build_optimizer
    from kforge_cli.engine.train.optim.scheduler import build_scheduler
    from kforge_cli.engine.train.recipe import build_checkpointer
    from kforge_cli.settings import load_settings

    run_dir = Path(out_dir) / name
    s = load_settings(overrides=overrides, use_env=False).settings
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    opt = build_optimizer(model, s.optimizer)
    mgr = build_checkpointer(
        s,
        runtime,
        run_dir,
        RunParts(model, opt, build_scheduler(opt, s.scheduler, s.train.max_steps, s.data.phases), TrainState()),
    )
    mgr.restore()
    mgr.save(0, blocking=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.save(
        {k: v.detach().cpu() for k, v in full.items() if isinstance(v, torch.Tensor)},
        run_dir / f"held.rank{dist.get_rank()}.pt",
    )
    return {"status": "completed"}


def _single_process_model() -> dict[str, torch.Tensor]:
    from kforge_cli.engine.parallel import build_parallel_model
    from kforge_cli.engine.runtime import init_runtime
    from kforge_cli.settings import load_settings

    s = load_settings(overrides=TINY, use_env=False).settings
    model, _ = build_parallel_model(s, init_runtime(s))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Runs the four cases; returns (output dir, the HF directory the warm-start cases read)."""
    from kforge_cli.engine.interop.hf_export import export_hf
    from tests.unit.test_inspect_ckpt import train_and_save

    root = tmp_path_factory.mktemp("sharded")
    source = train_and_save(root / "source", ["--model.n_layers=4", "--model.vocab_size=64"], steps=1)
    hf_dir = export_hf(source.steps[1], root / "hf").out_dir  # weights unlike any fresh init
    cases = {
        "fsdp": [*TINY, *FSDP],
        "pp": [*TINY, *PP],
        "fsdp_hf": [*TINY, *FSDP, f"--checkpoint.init_from={hf_dir}"],
        "pp_hf": [*TINY, *PP, f"--checkpoint.init_from={hf_dir}"],
    }
    results = run_ranks(2, [{"name": n, "fn": f"{__name__}:saved_case", "args": o} for n, o in cases.items()], root)
    for name, ranks in results.items():
        for rank, r in enumerate(ranks):
            assert r["status"] == "completed", f"{name} rank {rank}: {r.get('error', r['status'])}"
    return root, hf_dir


def _loaded(root: Path, case: str) -> dict[str, torch.Tensor]:
    from kforge_cli import load_model

    return {k: v.clone() for k, v in load_model(root / case / "checkpoints" / "step_0").state_dict().items()}


def _held(root: Path, case: str) -> dict[str, torch.Tensor]:
    """The union of what the ranks held (pipeline stages hold disjoint parts)."""
    out: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        out.update(torch.load(root / case / f"held.rank{rank}.pt", weights_only=True))
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.distributed
def test_fsdp_and_pp_checkpoints_load_to_the_same_single_process_model(launched: tuple[Path, Path]) -> None:
    from kforge_cli.engine.checkpoint.reader import open_checkpoint

    root, _ = launched
    fsdp_view = open_checkpoint(root / "fsdp" / "checkpoints" / "step_0")
    pp_view = open_checkpoint(root / "pp" / "checkpoints" / "step_0")
    assert fsdp_view.tensors["model.layers.0.attention.wq.weight"].shards == 2 and len(fsdp_view.dcp_dirs) == 1
    assert [d.name for d in pp_view.dcp_dirs] == ["pp_0", "pp_1"]  # one DCP dir per stage
    reference = _single_process_model()
    fsdp, pp = _loaded(root, "fsdp"), _loaded(root, "pp")
    _assert_equal(fsdp, reference)
    _assert_equal(pp, reference)
    _assert_equal(_held(root, "fsdp"), reference)
    _assert_equal(_held(root, "pp"), reference)


@pytest.mark.distributed
def test_hf_warm_start_under_fsdp_and_pp_loads_every_shard(launched: tuple[Path, Path]) -> None:
    from kforge_cli import load_model

    root, hf_dir = launched
    hf = {k: v.clone() for k, v in load_model(hf_dir).state_dict().items()}
    for case in ("fsdp_hf", "pp_hf"):
        _assert_equal(_held(root, case), hf)
        _assert_equal(_loaded(root, case), hf)
    fresh = _single_process_model()
    assert not torch.equal(hf["layers.3.feed_forward.w2.weight"], fresh["layers.3.feed_forward.w2.weight"])


@pytest.mark.distributed
def test_a_2_rank_fsdp_checkpoint_generates_what_its_one_process_model_generates(launched: tuple[Path, Path]) -> None:
    """Greedy and seeded sampling from the FSDP run dir (KV cache) equal the one-process models' tokens."""
    from kforge_cli import load_model
    from kforge_cli.engine.families.llama import Transformer
    from kforge_cli.engine.interop.open_checkpoint import open_for_inference
    from kforge_cli.engine.model.generation import Sampling, generate_tokens
    from kforge_cli.settings import load_settings

    root, hf_dir = launched
    single = Transformer(load_settings(overrides=TINY, use_env=False).settings.model)
    single.load_state_dict(_single_process_model())
    pairs = [
        (open_for_inference(root / "fsdp").model, single.eval()),
        (open_for_inference(root / "fsdp_hf").model, load_model(hf_dir)),
    ]
    prompt = [3, 14, 15, 9, 2]
    for sharded, reference in pairs:
        for sampling in (Sampling(temperature=0), Sampling(temperature=1.0, top_k=8)):
            got, want = (
                list(
                    generate_tokens(
                        m, prompt, max_new_tokens=12, sampling=sampling, generator=torch.Generator().manual_seed(5)
                    )
                )
                for m in (sharded, reference)
            )
            assert got == want and len(got) == 12
