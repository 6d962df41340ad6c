"""Bytes of text per token of a run's data, for losses in bits per byte (`kforge plot --bits-per-byte`).

A loss in nats per token depends on the tokenizer: a tokenizer with longer tokens has a
higher loss per token for the same model quality. Bits per byte divides that out:
``loss / ln 2 / (bytes per token)``. ``kforge prepare-data`` records each split's UTF-8
``text_bytes`` (no EOS) in metadata.json; for byte-tokenized data made before that, every
token but the EOS after each document is one byte, so the figure follows from the counts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from kforge_cli.common.files import MAX_METADATA_BYTES, read_text_capped
from kforge_cli.errors import InvalidInputError, KforgeError
from kforge_cli.rundir.saved_config import read_saved_config


def _split_bytes(meta: Mapping[str, object], split: str) -> tuple[int, int] | None:
    """(text bytes, tokens) of a split: recorded at prepare time; for the byte tokenizer also
    derivable (every token is a byte but the EOS after each document)."""
    splits = meta.get("splits")
    info = splits.get(split) if isinstance(splits, Mapping) else None
    if not isinstance(info, Mapping):
        return None
    tokens, text_bytes, documents = info.get("tokens"), info.get("text_bytes"), info.get("documents")
    if not isinstance(tokens, int) or not tokens:
        return None
    if isinstance(text_bytes, int):
        return text_bytes, tokens
    tokenizer = meta.get("tokenizer")
    if isinstance(tokenizer, Mapping) and tokenizer.get("kind") == "byte" and isinstance(documents, int):
        return tokens - documents, tokens
    return None


def _prepared(path: str, run_dir: Path, key: str) -> Mapping[str, object]:
    meta_path = Path(path).expanduser() / "metadata.json"
    try:
        meta = json.loads(read_text_capped(meta_path, MAX_METADATA_BYTES, "metadata"))
    except (OSError, ValueError, RecursionError, KforgeError) as exc:
        raise InvalidInputError(
            f"--bits-per-byte: cannot read {meta_path} ({key} of {run_dir}): {exc.__class__.__name__}"
        ) from None
    if not isinstance(meta, dict):
        raise InvalidInputError(f"--bits-per-byte: {meta_path} ({key} of {run_dir}) is not a JSON object")
    if not any(_split_bytes(meta, s) for s in ("train", "val")):
        raise InvalidInputError(
            f"--bits-per-byte: {meta_path} ({key} of {run_dir}) does not record its text bytes (prepared by an "
            "older kforge with a non-byte tokenizer): run `kforge prepare-data` on it again"
        )
    return meta


def _ratio(pairs: Sequence[tuple[int, int] | None]) -> float | None:
    known = [p for p in pairs if p is not None]
    total_bytes, tokens = sum(b for b, _ in known), sum(t for _, t in known)
    return total_bytes / tokens if known and tokens and total_bytes else None


def bytes_per_token(run_dir: Path) -> dict[str, float]:
    """``{"train": b, "val": b, "train/NAME": b, ...}``: UTF-8 bytes per token of the run's data.

    Read from the run's config.toml (data.path, data.datasets or the built-in corpus;
    eval.path for the eval loss when set) and each prepared directory's metadata.json. A
    mixture's train figure weighs each dataset's by its sampling weight.
    """
    config = read_saved_config(run_dir, missing_ok=True)  # capped, a FIFO refused; its accepted changes applied
    if not config:
        raise InvalidInputError(f"--bits-per-byte: {run_dir} has no readable config.toml to find its data")
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    assert isinstance(data, dict)
    out: dict[str, float] = {}
    datasets = [d for d in data.get("datasets") or [] if isinstance(d, dict)]
    if datasets:
        metas = {str(d["name"]): _prepared(str(d["path"]), run_dir, f"data.datasets {d['name']}") for d in datasets}
        weights = {str(d["name"]): float(d.get("weight", 1.0)) for d in datasets}
        for name, meta in metas.items():
            r = _ratio([_split_bytes(meta, "train")])
            if r is not None:
                out[f"train/{name}"] = r
        known = {n: out[f"train/{n}"] for n in metas if f"train/{n}" in out}
        if known:
            out["train"] = sum(weights[n] * r for n, r in known.items()) / sum(weights[n] for n in known)
        val = _ratio([_split_bytes(m, "val") for m in metas.values()])
    elif data.get("path"):
        meta = _prepared(str(data["path"]), run_dir, "data.path")
        out["train"] = _ratio([_split_bytes(meta, "train")]) or 0.0
        val = _ratio([_split_bytes(meta, "val")])
    else:
        from kforge_cli.engine.data.builtin_corpus import builtin_tokens
        from kforge_cli.engine.data.tokenizer import ByteTokenizer

        tokens, eos = builtin_tokens(), ByteTokenizer().eos_id
        for split in ("train", "val"):
            ids = tokens[split]
            out[split] = float((ids != eos).sum()) / len(ids)
        val = out["val"]
    eval_cfg = config.get("eval") if isinstance(config.get("eval"), dict) else {}
    assert isinstance(eval_cfg, dict)
    if eval_cfg.get("path"):
        meta = _prepared(str(eval_cfg["path"]), run_dir, "eval.path")
        val = _ratio([_split_bytes(meta, "val")]) or _ratio([_split_bytes(meta, "train")])
    out["val"] = val or out.get("train", 0.0)
    if not out.get("train"):
        out["train"] = out["val"]
    if not out["train"]:
        raise InvalidInputError(f"--bits-per-byte: no text bytes recorded for the data of {run_dir}")
    return out
