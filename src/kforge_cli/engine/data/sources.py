"""The training datasets a run's settings name: prepared directories (``data.datasets``, ``data.path``)
or the built-in demo corpus, each as its token streams, tokenizer identity and fingerprint.

Shared by the loader (`bundle.build_data`) and `kforge data-trace`; imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.engine.data.builtin_corpus import VERSION as BUILTIN_VERSION
from kforge_cli.engine.data.builtin_corpus import builtin_tokens
from kforge_cli.engine.data.shards import load_prepared
from kforge_cli.engine.data.tokenizer import ByteTokenizer
from kforge_cli.engine.data.tokens import ArrayTokens, ShardedTokens, TokenStream
from kforge_cli.errors import InvalidInputError
from kforge_cli.rundir.data_fingerprint import builtin_fingerprint, prepared_fingerprint
from kforge_cli.settings.data import DataSettings

BUILTIN_NAME = "builtin"


@dataclass
class Source:
    """One dataset: its token streams and the tokenizer identity they were made with."""

    name: str
    origin: str
    train: TokenStream
    val: TokenStream | None
    tokenizer: Mapping[str, object]  # metadata.json's tokenizer identity (or the byte tokenizer's)
    root: Path | None = None
    top_shard: tuple[int, str] = (-1, "")  # (largest token id, the shard holding it): checked against the model
    fingerprint: str = ""  # what a checkpoint records of this data (rundir.data_fingerprint)


def prepared_source(name: str, path: str) -> Source:
    meta = load_prepared(path)
    val = meta.splits.get("val")
    top = max(((s.max_id, s.path.name) for shards in meta.splits.values() for s in shards), default=(-1, ""))
    return Source(
        name=name,
        origin=str(meta.root),
        train=ShardedTokens(meta.splits["train"]),
        val=ShardedTokens(val) if val and meta.split_tokens("val") else None,
        tokenizer=meta.tokenizer,
        root=meta.root,
        top_shard=top,
        fingerprint=prepared_fingerprint(meta.root),
    )


def training_sources(data: DataSettings) -> list[Source]:
    if data.datasets:
        return [prepared_source(d.name, d.path) for d in data.datasets]
    if data.path:
        return [prepared_source(Path(data.path).name or "data", data.path)]
    if data.tokenizer != "byte":
        raise InvalidInputError(
            f"data.tokenizer={data.tokenizer!r} but no data.path: the built-in corpus is byte-tokenized. "
            "Prepare your data with `kforge prepare-data --tokenizer PATH` and set data.path."
        )
    tokens = builtin_tokens()
    return [
        Source(
            BUILTIN_NAME,
            "built-in corpus",
            ArrayTokens(tokens["train"]),
            ArrayTokens(tokens["val"]),
            ByteTokenizer().describe(),
            fingerprint=builtin_fingerprint(BUILTIN_VERSION),
        )
    ]
