"""The tokenizer of an exported model: what `AutoTokenizer.from_pretrained(OUT)` loads.

The tokenizer a run trained with is found from its ``config.toml``: ``data.tokenizer``
when it names a file (kforge records the prepared data's ``tokenizer.json`` there), else
the prepared data's own ``tokenizer.json`` / ``metadata.json``, else the byte tokenizer
(the built-in corpus and byte-prepared data). The byte tokenizer has no file of its own, so
export writes an equivalent one: a byte-level BPE without merges whose token for byte
``b`` has id ``b``, and ``<|endoftext|>`` at 256 (kforge's EOS). A ``tokenizer.json``
without an EOS token gets kforge's extra EOS id as ``<|endoftext|>``, so the ids agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
from kforge_cli.engine.data.tokenizer import ByteTokenizer, HFTokenizer
from kforge_cli.rundir.names import TOKENIZER_FILE
from kforge_cli.rundir.saved_config import read_saved_config

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ExportedTokenizer:
    source: str  # "byte" or the tokenizer.json path
    eos_id: int
    eos_token: str
    files: tuple[str, ...]


def run_tokenizer(checkpoint: Path) -> str | None:
    """'byte' or the tokenizer.json path a run trained with (None when its config.toml is missing)."""
    data = read_saved_config(Path(checkpoint).parent.parent, missing_ok=True).get("data")
    if not isinstance(data, dict):
        return None
    if data.get("tokenizer", "byte") != "byte":
        return str(data["tokenizer"])
    roots = [data["path"]] if data.get("path") else [d.get("path") for d in data.get("datasets", [])[:1]]
    for root in roots:
        if root and (Path(root) / TOKENIZER_FILE).is_file():
            return str(Path(root) / TOKENIZER_FILE)
    return "byte"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """A tokenizer.json that encodes text exactly like kforge's ByteTokenizer (id = byte, EOS = 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # pyright: ignore[reportAttributeAccessIssue]
    tok.decoder = decoders.ByteLevel()  # pyright: ignore[reportAttributeAccessIssue]
    tok.add_special_tokens([EOS_TOKEN])
    assert tok.token_to_id(EOS_TOKEN) == ByteTokenizer.eos_id
    return tok.to_str()


def _with_eos(path: Path, tok: HFTokenizer) -> tuple[str, str]:
    """The tokenizer.json text and its EOS token (adding kforge's extra EOS id when it has none)."""
    text = path.read_text(encoding="utf-8")
    if tok.eos_token is not None:
        return text, tok.eos_token
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(text)
    hf.add_special_tokens([EOS_TOKEN])
    if hf.token_to_id(EOS_TOKEN) != tok.eos_id:
        raise CheckpointError(f"{path}: cannot give {EOS_TOKEN} kforge's EOS id {tok.eos_id}")
    return hf.to_str(), EOS_TOKEN


def write_tokenizer(spec: str, out: Path, max_len: int) -> ExportedTokenizer:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out``."""
    if spec == "byte":
        text, eos_token, eos_id = byte_tokenizer_json(), EOS_TOKEN, ByteTokenizer.eos_id
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise CheckpointError(
                f"the run's tokenizer {path} is missing; pass --tokenizer PATH (or --tokenizer none to skip it)"
            )
        tok = HFTokenizer(path)
        text, eos_token = _with_eos(path, tok)
        eos_id = tok.eos_id
    special: dict[str, object] = {"bos_token": eos_token, "eos_token": eos_token, "unk_token": eos_token}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return ExportedTokenizer(spec, eos_id, eos_token, TOKENIZER_FILES)
