"""`kforge prepare-data`: text/JSONL -> memory-mapped token shards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("prepare-data")(prepare_data)


def prepare_data(
    inputs: Annotated[list[Path], typer.Argument(help="Text files, directories or JSONL files.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    tokenizer: Annotated[str, typer.Option("--tokenizer", help="'byte' or a tokenizer.json path.")] = "byte",
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="Fraction of documents for validation.")] = 0.01,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="Tokens per shard file.")] = 100_000_000,
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL field holding the text.")] = "text",
    skip_bad_records: Annotated[bool, typer.Option("--skip-bad-records", help="Skip and count bad records.")] = False,
) -> None:
    """Tokenize inputs into .npy shards plus metadata.json (streaming, all cores)."""
    from kforge_cli.errors import NotBuiltYetError

    raise NotBuiltYetError("prepare-data is not built yet (data issue)")
