"""`load_model` on vision-language checkpoints: each arch's trained weights and logits, convert-mot output, video MoT.

Each arch trains 3 steps through the real recipe (``run_training``, single process,
the vlm-mot-debug profile shrunk to unit size); a hook keeps the trained model's final
weights and its eval logits. ``load_model(RUN_DIR)`` must rebuild the same model from
the checkpoint alone: weights bit-equal, logits equal within 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from kforge_cli import load_model
from kforge_cli.engine.checkpoint import CheckpointError, RunParts
from kforge_cli.engine.checkpoint.dcp_io import quiet_single_process
from kforge_cli.engine.checkpoint.reader import open_checkpoint
from kforge_cli.engine.checkpoint.run_position import TrainState
from kforge_cli.engine.interop.mot_convert import convert_mot, dense_name
from kforge_cli.engine.model.vlm import VisionLanguageModel, build_vlm
from kforge_cli.engine.parallel import build_parallel_model
from kforge_cli.engine.runtime import init_runtime
from kforge_cli.engine.train import run_training
from kforge_cli.engine.train.hooks import TrainHook
from kforge_cli.engine.train.optim.optimizer import build_optimizer
from kforge_cli.engine.train.optim.scheduler import build_scheduler
from kforge_cli.engine.train.recipe import build_checkpointer
from kforge_cli.engine.train.run_dir import write_config
from kforge_cli.engine.train.session import TrainingSession
from kforge_cli.settings import JobSettings
from tests.unit.test_vlm_convert import dense_checkpoint
from tests.unit.test_vlm_model import inputs, vlm_settings

RUN = [
    "--train.max_steps=3",
    "--train.batch_size=2",
    "--scheduler.warmup_steps=1",
    "--eval.interval=0",
    "--metrics.log_interval=1",
    "--metrics.progress_bar=off",
    "--checkpoint.interval=0",
    "--vlm.cross_attention_every=1",
    "--optimizer.lr=1e-2",
]
TOL = 1e-6


@dataclass
class Trained:
    """What the training model held when the run ended, and the run it came from."""

    settings: JobSettings
    run_dir: Path
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    text_logits: torch.Tensor | None = None
    vision_logits: torch.Tensor | None = None


class KeepFinalModel(TrainHook):
    """Copies the trained model's weights and its eval-mode logits on fixed inputs at the end of the run."""

    def __init__(self, trained: Trained) -> None:
        self.trained = trained

    def on_train_end(self, session: TrainingSession, status: str) -> None:
        model = session.model
        self.trained.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ids, pixels = inputs(frames=2, seed=5)
        model.eval()
        with torch.no_grad():
            self.trained.text_logits = model(ids)
            self.trained.vision_logits = model(ids, pixel_values=pixels)


@pytest.fixture(scope="module", params=["mot", "joint_decoder", "cross_attention"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    run_dir = tmp_path_factory.mktemp(f"vlm_{request.param}") / "run"
    s = vlm_settings(f"--vlm.arch={request.param}", *RUN, f"--train.run_dir={run_dir}")
    out = Trained(s, run_dir)
    outcome = run_training(s, hooks=[KeepFinalModel(out)])
    assert outcome.status == "completed" and outcome.step == 3
    return out


def test_load_model_rebuilds_the_trained_vlm_bit_for_bit(trained: Trained) -> None:
    assert trained.settings.vlm is not None
    model = load_model(trained.run_dir)  # the run dir: its newest checkpoint, the final save at step 3
    assert open_checkpoint(trained.run_dir).step == 3
    assert isinstance(model, VisionLanguageModel) and not model.training
    assert model.arch == trained.settings.vlm.arch
    loaded = model.state_dict()
    assert set(loaded) == set(trained.weights)
    for name, value in loaded.items():
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.equal(value, trained.weights[name]), name
    torch.manual_seed(trained.settings.train.seed)
    fresh = build_vlm(trained.settings).state_dict()  # the run's step-0 weights: training moved them
    assert sum(not torch.equal(fresh[k], v) for k, v in loaded.items()) > len(loaded) // 2


def test_loaded_vlm_gives_the_training_models_eval_logits(trained: Trained) -> None:
    model = load_model(trained.run_dir)
    ids, pixels = inputs(frames=2, seed=5)
    assert trained.text_logits is not None and trained.vision_logits is not None
    with torch.no_grad():
        text, vision = model(ids), model(ids, pixel_values=pixels)
    assert text.shape == (2, 12, trained.settings.model.vocab_size)
    assert (text - trained.text_logits).abs().max().item() <= TOL
    assert (vision - trained.vision_logits).abs().max().item() <= TOL
    assert (vision - text).abs().max().item() > 1e-5  # the images matter, in every arch after training


def test_a_plain_dcp_dir_of_vlm_weights_needs_the_job_settings(trained: Trained, tmp_path: Path) -> None:
    with quiet_single_process():
        dcp_save({"model": dict(trained.weights)}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(CheckpointError, match="does not say which model"):
        load_model(tmp_path)
    model = load_model(tmp_path, model_settings=trained.settings)
    assert isinstance(model, VisionLanguageModel)
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained.weights[name]), name


def test_bf16_vlm_keeps_fp32_rope_tables(trained: Trained) -> None:
    model = load_model(trained.run_dir, dtype=torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32
    key = "vision.patch_embed.weight"
    assert torch.equal(model.state_dict()[key], trained.weights[key].to(torch.bfloat16))


def test_convert_mot_output_loads_and_gives_the_dense_logits_on_text(tmp_path: Path) -> None:
    ckpt, dense = dense_checkpoint(tmp_path)
    s = vlm_settings("--vlm.arch=mot")
    out = convert_mot(s, ckpt, tmp_path / "mot").path
    model = load_model(out)
    assert isinstance(model, VisionLanguageModel) and model.arch == "mot" and not model.training
    dense_params = dict(dense.named_parameters())
    for name, value in model.state_dict().items():
        if (d := dense_name(name)) is not None:
            assert torch.equal(value, dense_params[d]), name
    ids, pixels = inputs(batch=3)
    with torch.no_grad():
        diff = (model(ids) - dense(ids)).abs().max().item()
        with_images = model(ids, pixel_values=pixels)
    assert diff <= 1e-5, diff
    assert with_images.shape == (3, 12, s.model.vocab_size)


def _saved_untrained(tmp: Path, s: JobSettings, with_config: bool) -> tuple[Path, torch.nn.Module]:
    """A step-0 checkpoint of `s` through the real CheckpointManager (and the run's config.toml if asked)."""
    runtime = init_runtime(s)
    model, _ = build_parallel_model(s, runtime)
    opt = build_optimizer(model, s.optimizer)
    path = build_checkpointer(
        s,
        runtime,
        tmp,
        RunParts(model, opt, build_scheduler(opt, s.scheduler, s.train.max_steps, s.data.phases), TrainState()),
    ).save(0, blocking=True)
    if with_config:
        write_config(s, tmp)
    return path, model


@pytest.mark.parametrize(
    ("modalities", "with_config", "expected"),
    [
        ('["text", "image", "video"]', True, "video"),  # the run's config.toml has [video]
        ('["text", "video"]', False, "video"),  # no config.toml, but only a video expert exists
    ],
    ids=["config", "only-video"],
)
def test_a_video_mot_routes_frames_to_the_video_experts(
    tmp_path: Path, modalities: str, with_config: bool, expected: str
) -> None:
    s = vlm_settings("--vlm.arch=mot", f"--vlm.modalities={modalities}", "--video.max_frames=2")
    path, source = _saved_untrained(tmp_path, s, with_config)
    model = load_model(path)
    assert isinstance(model, VisionLanguageModel) and model.visual_modality == expected
    ids, pixels = inputs(frames=2)
    mask = torch.tensor([[True, True], [True, False]])
    with torch.no_grad():
        diff = model(ids, pixel_values=pixels, frame_mask=mask) - source(ids, pixel_values=pixels, frame_mask=mask)
    assert diff.abs().max().item() <= TOL  # experts are initialised independently: image routing would differ
