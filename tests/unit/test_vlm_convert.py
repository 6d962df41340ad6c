"""convert-mot and vlm.mot_warm_start_from: a dense text model's function and weights survive in the MoT model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kforge_cli.engine.checkpoint import (
    CheckpointError,
    Restored,
    RunParts,
    dcp_dirs,
    load_model_weights,
)
from kforge_cli.engine.checkpoint.reader import open_checkpoint, read_tensors
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.interop.mot_convert import convert_mot, dense_name, load_dense_into_mot, maybe_mot_warm_start
from kforge_cli.engine.model.vlm import build_vlm
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train.optim.optimizer import build_optimizer
from kforge_cli.engine.train.optim.scheduler import build_scheduler
from kforge_cli.engine.train.recipe import build_checkpointer
from kforge_cli.settings import load_settings
from tests.unit.test_vlm_model import VLM_TINY, inputs, vlm_settings

DENSE = [o for o in VLM_TINY if o.startswith(("--model.", "--train."))]


def dense_checkpoint(tmp: Path, *extra: str) -> tuple[Path, Transformer]:
    """A kforge text checkpoint (written by CheckpointManager) of a model with random norms too."""
    s = load_settings(
        profile="cpu-debug", overrides=[*DENSE, *extra, f"--checkpoint.dir={tmp / 'dense'}"], use_env=False
    ).settings
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    opt = build_optimizer(model, s.optimizer)
    manager = build_checkpointer(
        s,
        runtime,
        tmp,
        RunParts(model, opt, build_scheduler(opt, s.scheduler, s.train.max_steps, s.data.phases), TrainState()),
    )
    path = manager.save(3, blocking=True)
    assert isinstance(model, Transformer)
    return path, model


def test_dense_names() -> None:
    assert dense_name("layers.3.experts.image.attention.wq.weight") == "layers.3.attention.wq.weight"
    assert dense_name("tok_embeddings.weight") == "tok_embeddings.weight"
    assert dense_name("vision.layers.0.attn.qkv.weight") is None and dense_name("adapter.fc1.bias") is None


def test_converted_mot_gives_the_dense_logits_on_text(tmp_path: Path) -> None:
    ckpt, dense = dense_checkpoint(tmp_path)
    s = vlm_settings("--vlm.arch=mot")
    result = convert_mot(s, ckpt, tmp_path / "mot")
    view = open_checkpoint(result.path)  # a normal kforge checkpoint: inspect-ckpt reads it
    assert view.complete and view.step == 0
    from kforge_cli.cli.inspect_ckpt import _summary_text
    from kforge_cli.engine.checkpoint.inspection import summarize
    from kforge_cli.engine.checkpoint.verify import verify_checkpoint

    report = verify_checkpoint(result.path)  # weights only: complete without RNG or optimizer state
    assert report.ok, report.problems
    listing = _summary_text(summarize(view))
    assert "complete, weights only" in listing and "rank(s) ()" not in listing and "written by 1 rank;" in listing
    mot = build_vlm(s)
    load_model_weights(mot, dcp_dirs(result.path), [])
    ids, pixels = inputs(batch=3)
    diff = (mot(ids) - dense(ids)).abs().max().item()
    assert diff <= 1e-5, diff
    dense_params = dict(dense.named_parameters())
    mot_params = dict(mot.named_parameters())
    for name, p in mot_params.items():
        if (d := dense_name(name)) is not None:
            assert torch.equal(p, dense_params[d]), name  # every modality's copy starts from the dense weights
    with_images = mot(ids, pixel_values=pixels)  # image tokens present: the text side is still the dense model
    assert (with_images - dense(ids)).abs().max() > 1e-4
    for name, p in mot.named_parameters():
        if ".experts.text." in name or not name.startswith(("layers.", "vision.", "adapter.")):
            assert torch.equal(p, dense_params[dense_name(name) or name]), name
    stored = read_tensors(view, ["model.layers.1.experts.image.feed_forward.w2.weight"])
    assert torch.equal(
        stored["model.layers.1.experts.image.feed_forward.w2.weight"], dense_params["layers.1.feed_forward.w2.weight"]
    )
    with pytest.raises(Exception, match="not empty"):
        convert_mot(s, ckpt, tmp_path / "mot")


def test_a_hugging_face_llama_directory_converts_with_transformers_logits(tmp_path: Path) -> None:
    from tests.unit.test_hf_roundtrip import HF_MATCH, make_hf_llama

    hf = make_hf_llama(tmp_path / "hf", tied=False)
    s = vlm_settings(
        "--vlm.arch=mot",
        "--model.vocab_size=64",
        "--model.max_seq_len=32",
        "--train.seq_len=32",
        "--vlm.max_text_len=24",
        *HF_MATCH,
    )
    mot = build_vlm(s)
    load_dense_into_mot(mot, tmp_path / "hf", s)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (mot(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_a_differently_shaped_dense_model_is_refused_naming_the_fields(tmp_path: Path) -> None:
    ckpt, _ = dense_checkpoint(tmp_path, "--model.n_layers=3")
    with pytest.raises(CheckpointError, match=r"model\.n_layers: checkpoint 3, config 2.*--model\.n_layers=3"):
        load_dense_into_mot(build_vlm(vlm_settings("--vlm.arch=mot")), ckpt, vlm_settings("--vlm.arch=mot"))


def test_mot_warm_start_applies_to_fresh_runs_only(tmp_path: Path) -> None:
    ckpt, dense = dense_checkpoint(tmp_path)
    s = vlm_settings("--vlm.arch=mot", f"--vlm.mot_warm_start_from={ckpt}")
    torch.manual_seed(0)
    fresh = build_vlm(s)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    resumed = Restored("resume", tmp_path, 7, {})
    assert not maybe_mot_warm_start(s, fresh, resumed)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())
    assert maybe_mot_warm_start(s, fresh, None)
    ids, _ = inputs()
    assert (fresh(ids) - dense(ids)).abs().max() <= 1e-5
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters() if n.startswith(("vision.", "adapter.")))
    joint = vlm_settings("--vlm.arch=joint_decoder", f"--vlm.mot_warm_start_from={ckpt}")
    with pytest.raises(Exception, match="needs vlm.arch = 'mot'"):
        maybe_mot_warm_start(joint, build_vlm(joint), None)
