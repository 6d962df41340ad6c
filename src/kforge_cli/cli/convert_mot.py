"""`kforge convert-mot`: a dense text checkpoint -> a Mixture-of-Transformers warm start."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kforge_cli.cli.common import OVERRIDES, ConfigOpt, ProfileOpt


def register(app: typer.Typer) -> None:
    app.command("convert-mot", context_settings=OVERRIDES)(convert_mot)


def convert_mot(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="Dense text checkpoint (kforge DCP step dir or HF Llama dir).")],
    out: Annotated[Path, typer.Argument(help="Output directory for the MoT checkpoint.")],
    profile: ProfileOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Copy each text layer's weights into every modality of a MoT model (works on CPU).

    The MoT shape comes from the profile/config (default vlm-mot-debug when none given).
    """
    from kforge_cli.errors import NotBuiltYetError

    raise NotBuiltYetError("convert-mot is not built yet (VLM/MoT issue)")
