"""`kforge export-hf`: a kforge checkpoint -> Hugging Face safetensors + config.json of the architecture that holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("export-hf")(export_hf)


def export_hf(
    ckpt: Annotated[Path, typer.Argument(help="A kforge checkpoint (RUN_DIR/checkpoints/step_N) or a run dir.")],
    out: Annotated[Path, typer.Argument(help="Output directory (weights, config.json, tokenizer).")],
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="fp32, bf16 or fp16 (default: the checkpoint's dtype).")
    ] = None,
    max_shard_gb: Annotated[float, typer.Option("--max-shard-gb", help="Split weights into files of this size.")] = 5.0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="byte, a tokenizer.json path, or none (default: the tokenizer the run trained with).",
        ),
    ] = None,
) -> None:
    """Write the checkpoint as the transformers model that holds it exactly (Llama, Qwen3, Qwen3-MoE, GLM-4-MoE, ERNIE-4.5-MoE, DeepSeek-V3, Gemma 3, LLaVA), on CPU.

    Dense: LlamaForCausalLM (Qwen3ForCausalLM with QK-norm); model.family = gemma3:
    Gemma3ForCausalLM. Vision-language (joint decoder): LlavaForConditionalGeneration.

    MoE: Qwen3MoeForCausalLM (softmax router, QK-norm, no shared experts or selection bias),
    Glm4MoeForCausalLM (sigmoid router: DeepSeek-V3 routing, shared experts, bias, groups) or
    Ernie4_5_MoeForCausalLM (softmax router with bias and shared experts, no QK-norm).
    model.family = deepseek_v3: DeepseekV3ForCausalLM (its multi-token-prediction modules
    have no counterpart there and are dropped, with a warning).

    Load it with transformers' AutoModelForCausalLM (a VLM: AutoModelForImageTextToText).
    What none holds is refused, naming the fields. Continue pre-training a text model from
    it with --checkpoint.init_from=HF_DIR.
    """
    from kforge_cli.engine.interop.hf_export import export_hf as run_export
    from kforge_cli.errors import InvalidInputError

    if max_shard_gb <= 0:
        raise InvalidInputError("--max-shard-gb must be positive")
    result = run_export(
        ckpt, out, dtype=dtype, max_shard_bytes=int(max_shard_gb * 2**30), overwrite=overwrite, tokenizer=tokenizer
    )
    step = f" (step {result.step})" if result.step is not None else ""
    tok = result.tokenizer
    extra = " + config.json"
    if tok is not None:
        extra += f" + generation_config.json + tokenizer ({tok.source}, EOS {tok.eos_token!r} = id {tok.eos_id})"
    typer.echo(
        f"exported {result.tensors} tensors, {result.params:,} parameters{step} as {result.dtype} "
        f"{result.hf_class} to {result.out_dir}: {', '.join(result.files)}{extra}"
    )
    if tok is None:
        typer.echo(
            "no tokenizer written (the checkpoint has no run config.toml): pass --tokenizer byte or PATH", err=True
        )
