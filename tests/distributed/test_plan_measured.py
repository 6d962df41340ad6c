"""The plan (engine.plan) against real runs of the same configurations.

Three small configurations run for real on CPU with 1, 2 and 4 gloo ranks (the 2- and
4-rank ones in one launch each, ``measured_case`` the case every rank runs):
the planned parameter, gradient and optimizer-state bytes of every rank must equal the
measured ones exactly, and the activation estimate must be within 25% of the measured
peak. A pipeline case checks the bytes of each stage's rank (its activations are not
measured: the schedule runs several micro-batches).

How the activation peak is measured: torch's ``MemTracker`` (``FSDPMemTracker`` under
FSDP) records every tensor allocation during one forward + backward and the snapshot at
the moment of the highest total; the measured activation peak is the ``Activation`` +
``Temp`` categories of that snapshot, i.e. everything but parameters (sharded and
gathered), gradients, buffers, optimizer state and FSDP's own collective buffers. (FSDP's
unsharded gradients, which the tracker leaves in ``Temp``, are part of it.)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers import tiny
from tests.helpers.launch import run_ranks

TOLERANCE = 0.25
BASE = [  # bigger than the tests' tiny models: activations must dominate what the tracker sees
    *tiny.model(128, 4, 4, 2, max_seq_len=512),
    "--train.seq_len=256",
    "--train.batch_size=4",
    "--train.device=cpu",
    "--checkpoint.interval=0",
    "--eval.interval=0",
]
AUTOCAST_OP_AC = [
    "--train.mixed_precision=bf16",
    "--train.activation_checkpointing=selective",
    "--train.ac_selective_mode=op",
    "--optimizer.name=lion",
    "--model.activation=gelu",
]
FSDP_FULL_AC = [
    "--train.mixed_precision=fp32",
    "--train.activation_checkpointing=full",
    "--train.loss_chunk_size=256",
    "--model.vocab_size=1024",
]
TP_FSDP_BLOCK_AC = [
    "--train.mixed_precision=bf16",
    "--distributed.tp=2",
    "--train.activation_checkpointing=selective",
    "--model.qk_norm=true",
    "--optimizer.name=muon",
]
PIPELINE = ["--train.mixed_precision=fp32", "--distributed.pp=2", "--train.grad_accum_steps=2"]
# world size -> {case: overrides}; each exercises another path of the estimate and the optimizer rule.
CASES: dict[int, dict[str, list[str]]] = {
    1: {"autocast_bf16_op_ac_lion_gelu": [*BASE, *AUTOCAST_OP_AC]},
    2: {"fsdp2_full_ac_chunked_loss": [*BASE, *FSDP_FULL_AC], "pp2_1f1b": [*BASE, *PIPELINE]},
    4: {"tp2_fsdp2_sp_bf16_block_ac_muon": [*BASE, *TP_FSDP_BLOCK_AC]},
}
NO_STEP = {"pp2_1f1b"}  # bytes only: the optimizer state is made from zero gradients


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _tracker(model: Any, optimizer: Any, distributed: bool) -> Any:
    if distributed:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def measure(overrides: list[str], *, run_step: bool = True) -> dict[str, Any]:
    """Build the real model and optimizer of ``overrides`` on this rank, run one step, return what it held."""
    import torch

    from kforge_cli.engine.parallel import build_parallel_model, compute_dtype
    from kforge_cli.engine.runtime import init_runtime
    from kforge_cli.engine.train.loss import build_loss_fn
    from kforge_cli.engine.train.optim.optimizer import build_optimizer
    from kforge_cli.engine.train.step.core import loss_sum_from_output, model_computes_loss
    from kforge_cli.settings import load_settings

    s = load_settings(overrides=overrides).settings
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    optimizer = build_optimizer(model, s.optimizer)
    out: dict[str, Any] = {"params": sum(_local_bytes(p) for p in model.parameters()), "activation_peak": None}
    if run_step:
        t, device = s.train, runtime.device
        tokens = torch.randint(
            0, s.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0)
        ).to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        loss_fn = build_loss_fn(s)
        session: Any = SimpleNamespace(loss_fn=loss_fn, runtime=runtime)  # what the step's loss helpers read
        cdtype = compute_dtype(s, device)
        single_mp = runtime.world_size == 1 and cdtype != torch.float32
        autocast = torch.autocast(device.type, dtype=cdtype) if single_mp else nullcontext()
        tracker = _tracker(model, optimizer, runtime.world_size > 1)
        with tracker:
            with autocast:
                if model_computes_loss(session):
                    loss = model(inputs, labels=labels, loss_fn=loss_fn)
                else:
                    loss = loss_sum_from_output(session, model(inputs), labels)
            loss.backward()
        snap = tracker.get_tracker_snapshot("peak")[device]
        named = {str(getattr(k, "value", k)): v for k, v in snap.items()}
        out["activation_peak"] = named["Activation"] + named["Temp"]
    else:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    out["grads"] = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer.step()
    out["optimizer"] = sum(
        _local_bytes(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    return out


def measured_case(name: str, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """A case of a multi-rank launch (tests.helpers.ranks): what this rank's model and optimizer held."""
    del out_dir
    return measure(overrides, run_step=name not in NO_STEP)


def launch(world: int, out_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Measure CASES[world] in one ``world``-rank launch; {case: [rank results]}."""
    cases = [{"name": n, "fn": f"{__name__}:measured_case", "args": o} for n, o in CASES[world].items()]
    return run_ranks(world, cases, out_dir)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[dict[str, Any]]]]:
    results = {1: {n: [measure(o)] for n, o in CASES[1].items()}}
    for world in (2, 4):
        results[world] = launch(world, tmp_path_factory.mktemp(f"plan-world{world}"))
    return results


def _plan(overrides: list[str], world: int, rank: int) -> Any:
    from kforge_cli.engine.plan.planner import build_plan
    from kforge_cli.settings import load_settings

    return build_plan(load_settings(overrides=overrides).settings, world, rank)


CASE_IDS = [(w, n) for w, cases in CASES.items() for n in cases]


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "name"), CASE_IDS, ids=[f"{w}ranks-{n}" for w, n in CASE_IDS])
def test_planned_bytes_equal_measured(measured: dict, world: int, name: str) -> None:
    for rank, got in enumerate(measured[world][name]):
        plan = _plan(CASES[world][name], world, rank)
        assert plan.item("parameters").bytes == got["params"], (name, rank)
        assert plan.item("gradients").bytes == got["grads"], (name, rank)
        assert plan.item("optimizer state").bytes == got["optimizer"], (name, rank)


ACTIVATION_IDS = [(w, n) for w, n in CASE_IDS if n not in NO_STEP]


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "name"), ACTIVATION_IDS, ids=[f"{w}ranks-{n}" for w, n in ACTIVATION_IDS])
def test_activation_estimate_within_25_percent(
    measured: dict, world: int, name: str, record_property: Callable[[str, object], None]
) -> None:
    for rank, got in enumerate(measured[world][name]):
        estimate = _plan(CASES[world][name], world, rank).item("activations").bytes
        error = (estimate - got["activation_peak"]) / got["activation_peak"]
        print(
            f"\n{name} rank {rank}: estimate {estimate / 2**20:.2f} MiB, measured "
            f"{got['activation_peak'] / 2**20:.2f} MiB, error {error:+.1%}"
        )
        record_property(f"activation_error_rank{rank}", round(error, 4))
        assert abs(error) <= TOLERANCE, (name, rank, estimate, got["activation_peak"])


@pytest.mark.gpu
def test_activation_estimate_on_gpu(record_property: Callable[[str, object], None]) -> None:
    """A bf16 single-GPU step (autocast, selective op AC, chunked loss): estimate vs the tracked CUDA peak."""
    overrides = [
        "--model.dim=1024",
        "--model.n_layers=8",
        "--model.n_heads=16",
        "--model.n_kv_heads=4",
        "--model.vocab_size=32000",
        "--model.max_seq_len=2048",
        "--train.seq_len=2048",
        "--train.batch_size=4",
        "--train.device=cuda",
        "--train.mixed_precision=bf16",
        "--train.activation_checkpointing=selective",
        "--train.ac_selective_mode=op",
        "--train.loss_chunk_size=2048",
        "--slurm.gpu_type=h100",
    ]
    got = measure(overrides)
    estimate = _plan(overrides, 1, 0).item("activations").bytes
    error = (estimate - got["activation_peak"]) / got["activation_peak"]
    print(
        f"\nGPU: estimate {estimate / 2**20:.1f} MiB, measured {got['activation_peak'] / 2**20:.1f} MiB, {error:+.1%}"
    )
    record_property("gpu_activation_error", round(error, 4))
    assert abs(error) <= TOLERANCE
