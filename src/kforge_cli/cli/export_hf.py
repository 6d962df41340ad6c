"""`kforge export-hf`: a kforge checkpoint -> Hugging Face Llama safetensors + config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("export-hf")(export_hf)


def export_hf(
    ckpt: Annotated[Path, typer.Argument(help="A kforge checkpoint (RUN_DIR/checkpoints/step_N) or a run dir.")],
    out: Annotated[Path, typer.Argument(help="Output directory for model.safetensors + config.json.")],
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="fp32, bf16 or fp16 (default: the checkpoint's dtype).")
    ] = None,
    max_shard_gb: Annotated[float, typer.Option("--max-shard-gb", help="Split weights into files of this size.")] = 5.0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Write the checkpoint's model in the Hugging Face Llama layout (LlamaForCausalLM), on CPU.

    Load it with transformers.LlamaForCausalLM.from_pretrained(OUT). Text models with
    RMSNorm, SwiGLU and no QK-norm only. Continue pre-training an HF Llama with
    --checkpoint.init_from=HF_DIR.
    """
    from kforge_cli.engine.checkpoint.hf_export import export_hf as run_export
    from kforge_cli.errors import InvalidInputError

    if max_shard_gb <= 0:
        raise InvalidInputError("--max-shard-gb must be positive")
    result = run_export(ckpt, out, dtype=dtype, max_shard_bytes=int(max_shard_gb * 2**30), overwrite=overwrite)
    step = f" (step {result.step})" if result.step is not None else ""
    typer.echo(
        f"exported {result.tensors} tensors, {result.params:,} parameters{step} as {result.dtype} "
        f"to {result.out_dir}: {', '.join(result.files)} + config.json"
    )
