"""`kforge convert-mot`: a dense text checkpoint -> a Mixture-of-Transformers warm start."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kforge_cli.cli.options import OVERRIDES, ConfigOpt, resolve

MOT_PROFILE = "vlm-mot-debug"


def register(app: typer.Typer) -> None:
    app.command("convert-mot", context_settings=OVERRIDES)(convert_mot)


def convert_mot(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="Dense text checkpoint (kforge DCP step dir or HF Llama dir).")],
    out: Annotated[Path, typer.Argument(help="Output directory for the MoT checkpoint.")],
    profile: Annotated[
        str | None,
        typer.Option("--profile", "-p", help=f"The MoT model: a profile name or a .toml path. Default: {MOT_PROFILE}."),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Copy each text layer's weights into every modality of a MoT model (works on CPU).

    The MoT model comes from --profile (default vlm-mot-debug) and --config; its [model]
    table must describe the dense model. SRC is a kforge checkpoint (step dir or run dir)
    or a Hugging Face Llama directory. OUT becomes a kforge checkpoint: start a MoT run
    from it with --checkpoint.init_from=OUT (or skip this step and set
    --vlm.mot_warm_start_from=SRC on a fresh run).
    """
    from kforge_cli.engine.interop.mot_convert import convert_mot as run_convert

    settings = resolve(profile or MOT_PROFILE, config, list(ctx.args)).settings
    result = run_convert(settings, src, out)
    typer.echo(
        f"wrote MoT checkpoint {result.path}: {result.tensors} tensors from {src}, "
        f"{result.parameters:,} parameters (step 0)"
    )
