"""A checkpoint argument -> the model, its tokenizer, its run directory and its step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from kforge_cli.engine.checkpoint.reader import open_checkpoint
from kforge_cli.engine.data.run_tokenizer import run_tokenizer
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer
from kforge_cli.engine.interop.load_model import LoadedModel, load_model
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.checkpoints import is_hf_dir
from kforge_cli.rundir.layout import RunDir
from kforge_cli.rundir.names import TOKENIZER_FILE
from kforge_cli.settings.training import ModelSettings


@dataclass
class LoadedCheckpoint:
    """What generation and evaluation need from ``CKPT_OR_RUN_DIR``."""

    model: LoadedModel
    tokenizer: ByteTokenizer | HFTokenizer
    path: Path  # the step dir (or HF dir) actually loaded
    run_dir: Path | None  # None: not inside a kforge run directory
    step: int | None

    @property
    def cfg(self) -> ModelSettings:
        """The text model's settings (every family's model, and a VLM's decoder, keeps them as ``cfg``)."""
        return cast(ModelSettings, self.model.cfg)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def open_for_inference(
    checkpoint: str | Path, *, dtype: str = "fp32", device: str = "cpu", tokenizer: str | None = None
) -> LoadedCheckpoint:
    """Load `checkpoint` (a step dir, a run dir or a Hugging Face text dir) with the tokenizer it was trained with."""
    if dtype not in DTYPES:
        raise InvalidInputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_device(device)
    path = Path(checkpoint)
    if not path.exists():
        raise InvalidInputError(f"{path} does not exist; give a run directory or RUN_DIR/checkpoints/step_N")
    if is_hf_dir(path):
        hf_tok = path / TOKENIZER_FILE
        if tokenizer is None and not hf_tok.is_file():
            raise InvalidInputError(
                f"{path} has no {TOKENIZER_FILE}: pass the model's tokenizer with --tokenizer PATH "
                "(or --tokenizer byte for a byte-level model)"
            )
        tok = run_tokenizer(None, tokenizer or str(hf_tok))
        return LoadedCheckpoint(load_model(path, dtype=DTYPES[dtype], device=device), tok, path, None, None)
    view = open_checkpoint(path)
    run = RunDir.of_checkpoint(view.path) if view.kforge else None
    run_dir = run.path if run is not None else None
    tok = run_tokenizer(run_dir, tokenizer, str(view.path))
    model = load_model(view.path, dtype=DTYPES[dtype], device=device)
    return LoadedCheckpoint(model, tok, view.path, run_dir, view.step)


def check_device(device: str) -> None:
    """``--device``: cpu, cuda or cuda:N that this machine has (else exit 2 before anything is loaded)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"--device {device!r} is not a device: give cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"--device {device!r}: kforge runs inference on cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError(f"--device {device}: this machine has no usable CUDA GPU; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")


def check_tokenizer_fits(loaded: LoadedCheckpoint) -> None:
    """Refuse a tokenizer with more ids than the model's vocabulary (checked before any text is encoded)."""
    vocab = int(loaded.cfg.vocab_size)
    if loaded.tokenizer.vocab_size > vocab:
        raise InvalidInputError(
            f"tokenizer {loaded.tokenizer.name} has {loaded.tokenizer.vocab_size} ids but the model's vocabulary is "
            f"{vocab}: pass the tokenizer this checkpoint was trained with (--tokenizer)"
        )
