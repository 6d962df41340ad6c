"""engine.data: tokenizers, prepared token shards, the sample order, mixtures, the stateful loader.

Names are resolved lazily so that `kforge prepare-data` (and its worker processes)
import only numpy and tokenizers, not torch.

    from kforge_cli.engine.data import build_data, DataBundle
    bundle = build_data(settings, dp_rank=0, dp_size=1)
    batch = next(iter(bundle.train))   # input_ids, labels, dataset_ids [, doc_ids, positions]
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kforge_cli.engine.data.bundle import DataBundle, EvalBatches, TrainData, ValData, build_data
    from kforge_cli.engine.data.loader import DataStateError, StatefulLoader
    from kforge_cli.engine.data.prepare import PrepareResult, prepare_data
    from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

_EXPORTS = {
    "DataBundle": "bundle",
    "ValData": "bundle",
    "TrainData": "bundle",
    "EvalBatches": "bundle",
    "build_data": "bundle",
    "DataStateError": "loader",
    "StatefulLoader": "loader",
    "PrepareResult": "prepare",
    "prepare_data": "prepare",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "ByteTokenizer",
    "DataBundle",
    "DataStateError",
    "EvalBatches",
    "HFTokenizer",
    "PrepareResult",
    "StatefulLoader",
    "Tokenizer",
    "TrainData",
    "ValData",
    "build_data",
    "load_tokenizer",
    "prepare_data",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
