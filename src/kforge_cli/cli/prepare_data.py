"""`kforge prepare-data`: text/JSONL/local Hugging Face datasets -> memory-mapped token shards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kforge_cli.common.prepare_defaults import (
    PREPARE_SHARD_TOKENS,
    PREPARE_TEXT_FIELD,
    PREPARE_TOKENIZER,
    PREPARE_VAL_FRACTION,
)


def register(app: typer.Typer) -> None:
    app.command("prepare-data")(prepare_data)


def prepare_data(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            help="Text files, directories, JSONL files, or local Hugging Face datasets: a save_to_disk "
            "directory, .parquet/.arrow files, or hf:PATH (never downloaded)."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    tokenizer: Annotated[str, typer.Option("--tokenizer", help="'byte' or a tokenizer.json path.")] = PREPARE_TOKENIZER,
    val_fraction: Annotated[
        float, typer.Option("--val-fraction", help="Fraction of documents for validation.")
    ] = PREPARE_VAL_FRACTION,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="Tokens per shard file.")] = PREPARE_SHARD_TOKENS,
    text_field: Annotated[
        str, typer.Option("--text-field", help="JSONL field or dataset column holding the text.")
    ] = PREPARE_TEXT_FIELD,
    hf_split: Annotated[
        str | None, typer.Option("--hf-split", help="Split of a DatasetDict input (default: train, or its only one).")
    ] = None,
    skip_bad_records: Annotated[bool, typer.Option("--skip-bad-records", help="Skip and count bad records.")] = False,
    workers: Annotated[
        int, typer.Option("--workers", help="Tokenizer processes (0 = all cores the input keeps busy).", min=0)
    ] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace a prepared --out that holds other data (refused without)."),
    ] = False,
) -> None:
    """Tokenize inputs into .npy shards plus metadata.json (streaming, all cores).

    A Hugging Face dataset is tokenized like JSONL (one document per record); training then
    reads the output like any other prepared directory, sharded exactly and resumably across
    ranks and loader workers. Hugging Face inputs need `pip install 'kforge[hf]'`.

    Exit codes: 0 done (or already up to date), 2 invalid input (the file and line named),
    130 Ctrl-C, 143 SIGTERM. A stopped run leaves --out as it was: the output is written
    to a temporary directory, made durable, then renamed into place. Running it again on
    unchanged inputs does nothing; an --out prepared from other inputs or options is
    replaced only with --overwrite.
    """
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from kforge_cli.engine.data.prepare.prepare_run import prepare_data as run

    err = Console(stderr=True, soft_wrap=True)  # lines printed above the bar keep paths whole
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, disable=quiet, transient=True) as progress:
        task = progress.add_task("tokenizing", total=None)
        result = run(
            inputs,
            out,
            tokenizer=tokenizer,
            val_fraction=val_fraction,
            shard_tokens=shard_tokens,
            text_field=text_field,
            skip_bad_records=skip_bad_records,
            workers=workers or None,
            hf_split=hf_split,
            overwrite=overwrite,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total),
        )
    if result.reused:
        typer.echo(f"{result.out} is up to date with its inputs: nothing to do")
        return
    typer.echo(
        f"wrote {result.out}: {result.tokens['train']:,} train + {result.tokens['val']:,} val tokens, "
        f"{result.dtype}, vocab {result.vocab_size}"
    )
    typer.echo(documents_line(result.documents, result.documents_by_kind, result.text_files))
    typer.echo(
        f"{result.input_bytes / 1e6:,.1f} MB in {result.seconds:.2f} s with {result.workers} worker(s): "
        f"{result.tokens_per_second:,.0f} tokens/s"
    )
    if result.skipped_records or result.skipped_files:
        typer.echo(f"skipped {result.skipped_records} bad record(s) and {result.skipped_files} empty file(s)")


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def documents_line(documents: dict[str, int], by_kind: dict[str, dict[str, int]] | None, text_files: int | None) -> str:
    """``documents (each ends with EOS): 502 train + 1 val = 500 JSONL records + 1 text file in 3 pieces ...``.

    The same definitions as metadata.json's ``documents``: a JSONL record, a dataset row,
    a text file (each contiguous piece of it within a split, when the val split cuts it).
    """
    line = f"documents (each ends with EOS): {documents['train']:,} train + {documents['val']:,} val"
    if by_kind is None:
        return line
    total = {kind: sum(split[kind] for split in by_kind.values()) for kind in ("jsonl", "hf", "text")}
    parts = []
    if total["jsonl"]:
        parts.append(_count(total["jsonl"], "JSONL record", "JSONL records"))
    if total["hf"]:
        parts.append(_count(total["hf"], "dataset row", "dataset rows"))
    if total["text"]:
        files = text_files or total["text"]
        text = _count(files, "text file", "text files")
        if total["text"] > files:
            text += f" in {total['text']:,} pieces (the val split takes lines out of text files; a piece is a document)"
        parts.append(text)
    return f"{line} = {' + '.join(parts)}" if parts else line
