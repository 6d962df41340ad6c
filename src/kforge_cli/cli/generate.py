"""`kforge generate`: sample text from any checkpoint, streamed to the terminal (KV cache, CPU or one GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import torch

    from kforge_cli.engine.interop.open_checkpoint import LoadedCheckpoint


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)


MAX_PROMPT_BYTES = 8 << 20  # --prompt-file and standard input: a prompt longer than any model's context is refused


def _decode_capped(data: bytes, what: str) -> str:
    from kforge_cli.errors import InvalidInputError

    if len(data) > MAX_PROMPT_BYTES:
        raise InvalidInputError(
            f"{what} is longer than {MAX_PROMPT_BYTES} bytes (kforge reads at most that much): no model's "
            "context holds it; shorten it or split it into prompts"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"{what} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _prompts(prompt: list[str] | None, prompt_file: Path | None) -> list[str]:
    """--prompt values, then one prompt per non-empty line of --prompt-file; stdin when neither is given.

    Both are read capped at ``MAX_PROMPT_BYTES`` (exit 2 beyond it); --prompt-file only as a
    regular file (``/dev/zero`` or a FIFO is refused unread: pipe text on standard input instead).
    """
    from kforge_cli.common.files import open_regular
    from kforge_cli.errors import InvalidInputError

    prompts = list(prompt or [])
    if prompt_file is not None:
        try:
            with open_regular(prompt_file) as f:
                data = f.read(MAX_PROMPT_BYTES + 1)
        except InvalidInputError as exc:
            raise InvalidInputError(f"--prompt-file: {exc} (pipe a stream on standard input instead)") from None
        except OSError as exc:
            raise InvalidInputError(f"--prompt-file {prompt_file} is unreadable ({exc.strerror or exc})") from None
        prompts += [line for line in _decode_capped(data, f"--prompt-file {prompt_file}").splitlines() if line.strip()]
    if not prompts and prompt_file is None:
        if sys.stdin.isatty():
            raise InvalidInputError("no prompt: pass --prompt TEXT, --prompt-file FILE, or pipe text on stdin")
        stream = getattr(sys.stdin, "buffer", None)  # a test's replaced stdin may be text only
        raw = stream.read(MAX_PROMPT_BYTES + 1) if stream is not None else sys.stdin.read(MAX_PROMPT_BYTES + 1).encode()
        text = _decode_capped(raw, "the prompt on standard input")
        if text.strip():
            prompts.append(text.rstrip("\n"))
    if not prompts:
        raise InvalidInputError("no prompt: every prompt given is empty")
    return prompts


def _read_image(loaded: LoadedCheckpoint, path: Path) -> torch.Tensor:
    """The image as ``[C, H, W]`` in [0, 1] at the VLM's encoder size (exit 2 for a text model or a bad file)."""
    import torch

    from kforge_cli.engine.data.vlm.media import read_image_file
    from kforge_cli.engine.model.vlm import VisionLanguageModel
    from kforge_cli.errors import InvalidInputError

    model = getattr(loaded, "model", None)
    if not isinstance(model, VisionLanguageModel):
        raise InvalidInputError(
            f"--image needs a vision-language checkpoint; {getattr(loaded, 'path', '')} holds a text model"
        )
    vision = model.vision
    size, channels = int(vision.image_size), int(vision.channels)  # type: ignore[arg-type]
    return torch.from_numpy(read_image_file(path, size, channels))


def generate(
    ckpt: Annotated[
        Path, typer.Argument(help="A run dir, RUN_DIR/checkpoints/step_N, or a Hugging Face dir (an export-hf output).")
    ],
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", help="One prompt per line.")] = None,
    image: Annotated[
        Path | None,
        typer.Option("--image", help="An image placed before every prompt (vision-language checkpoints)."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to add per prompt.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Sample from the k likeliest (0 = all).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed for reproducible sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop before this string (repeatable).")] = None,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="'byte' or a tokenizer.json (default: the run's own).")
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="fp32, bf16 or fp16.")] = "fp32",
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute every step (no KV cache).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per prompt, no streaming.")] = False,
) -> None:
    """Continue each prompt with the checkpoint's model and its own tokenizer; stops at EOS or --stop."""
    from kforge_cli.errors import InvalidInputError

    prompts = _prompts(prompt, prompt_file)
    from kforge_cli.engine.inference.sampling import check_prompts, generate_text
    from kforge_cli.engine.interop.open_checkpoint import open_for_inference
    from kforge_cli.engine.model.generation import Sampling

    try:
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    loaded = open_for_inference(ckpt, dtype=dtype, device=device, tokenizer=tokenizer)
    pixels = _read_image(loaded, image) if image is not None else None  # an image needs a VLM checkpoint
    check_prompts(loaded, prompts)  # all of them, before any output: an error names the prompt by its place (from 1)

    def stream(index: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    results = []
    for index, text in enumerate(prompts):
        if not as_json:
            if index:
                typer.echo("\n")
            sys.stdout.write(text)
        (done,) = generate_text(
            loaded,
            [text],
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            seed=None if seed is None else seed + index,
            stop=stop,
            use_cache=not no_cache,
            on_text=None if as_json else stream,
            image=pixels,
        )
        results.append(done)
        if as_json:
            typer.echo(json.dumps({**done.as_dict(), "checkpoint": str(loaded.path), "step": loaded.step}))
    if not as_json:
        typer.echo("")
