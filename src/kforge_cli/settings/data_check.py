"""Settings against the disk, before a GPU is spent: data exists and agrees with the model.

`validate-config`, `--sbatch` and `kforge train` run these checks on the resolved settings.
They read only each prepared directory's ``metadata.json`` (JSON, no numpy, no torch), so a
missing ``data.path``, a ``model.vocab_size`` smaller than the data's tokenizer, or a GPU
profile that would train on the built-in demo corpus is an exit 2 on the login node rather
than a failure after the job waited in the queue. The engine's data layer still checks the
shards themselves when it opens them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kforge_cli.common.files import MAX_METADATA_BYTES, read_text_capped
from kforge_cli.common.json_values import dict_of
from kforge_cli.errors import ConfigIssue, InvalidInputError
from kforge_cli.rundir.names import TOKENIZER_FILE
from kforge_cli.settings.job import JobSettings

METADATA = "metadata.json"  # engine.data.shards.METADATA (that module imports numpy)

# (section, field) of every setting that names a file or directory: stored absolute in config.toml.
PATH_FIELDS = (
    ("data", "path"),
    ("data", "tokenizer"),
    ("eval", "path"),
    ("checkpoint", "dir"),
    ("checkpoint", "load_path"),
    ("checkpoint", "init_from"),
    ("profiling", "trace_dir"),
    ("train", "run_dir"),
    ("vision_encoder", "path"),
    ("vlm", "data_path"),
    ("vlm", "mot_warm_start_from"),
)

DEMO_CORPUS_HINT = (
    "not set, so this GPU profile would train on the built-in demo corpus (meant for the CPU profiles); "
    "prepare your data with `kforge prepare-data FILES --out DIR` and set --data.path=DIR"
)


def _absolute(value: str, base: Path) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def make_paths_absolute(settings: JobSettings, base: Path | None = None) -> None:
    """Resolve every relative path setting against ``base`` (the cwd), in place.

    A run's config.toml must mean the same files from any directory: `kforge resume RUN`
    from elsewhere, or a SLURM job whose working directory differs.
    """
    base = (base or Path.cwd()).resolve()
    for section_name, name in PATH_FIELDS:
        section = getattr(settings, section_name, None)
        value = getattr(section, name, None) if section is not None else None
        is_byte = (section_name, name) == ("data", "tokenizer") and value == "byte"
        if not isinstance(value, str) or not value or is_byte:
            continue
        setattr(section, name, _absolute(value, base))
    for spec in settings.data.datasets:
        spec.path = _absolute(spec.path, base)


def _read_metadata(key: str, root: Path) -> tuple[dict[str, object] | None, ConfigIssue | None]:
    if not root.is_dir():
        return None, ConfigIssue(key, f"{root} does not exist; create it with `kforge prepare-data FILES --out {root}`")
    try:
        meta: object = json.loads(read_text_capped(root / METADATA, MAX_METADATA_BYTES, "metadata"))
    except FileNotFoundError:
        return None, ConfigIssue(key, f"{root} has no {METADATA}: it is not a directory made by `kforge prepare-data`")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, InvalidInputError) as exc:
        return None, ConfigIssue(key, f"{root / METADATA} is unreadable ({exc})")
    if not isinstance(meta, dict) or not isinstance(meta.get("tokenizer"), dict):
        return None, ConfigIssue(key, f"{root / METADATA} is not kforge token metadata")
    return meta, None


def _tokenizer_issue(key: str, root: Path, tokenizer: dict[str, object], requested: str) -> ConfigIssue | None:
    if requested == "byte":
        return None  # the default: use whatever the data was prepared with
    if tokenizer.get("kind") == "byte":
        return ConfigIssue(
            "data.tokenizer",
            f"{requested!r} but {root} ({key}) was prepared with the byte tokenizer; "
            "set data.tokenizer=byte or prepare the data again with your tokenizer",
        )
    path = Path(requested).expanduser()
    if not path.is_file():
        return ConfigIssue("data.tokenizer", f"{requested} does not exist")
    if hashlib.sha256(path.read_bytes()).hexdigest() != tokenizer.get("sha256"):
        return ConfigIssue(
            "data.tokenizer",
            f"{requested} is not the tokenizer {root} ({key}) was prepared with; leave data.tokenizer at its "
            f"default to use the prepared one ({root / TOKENIZER_FILE})",
        )
    return None


def data_issues(settings: JobSettings) -> list[ConfigIssue]:
    """What in the settings disagrees with the data on disk (empty when all agree)."""
    s = settings
    out: list[ConfigIssue] = []
    if s.vlm is not None:
        if s.vlm.data_path and not Path(s.vlm.data_path).expanduser().exists():
            out.append(ConfigIssue("vlm.data_path", f"{s.vlm.data_path} does not exist"))
        return out
    sources = [("data.path", s.data.path)] if s.data.path else []
    sources += [(f"data.datasets.{i}.path", d.path) for i, d in enumerate(s.data.datasets)]
    if not sources and s.slurm.gpu_type != "cpu":
        out.append(ConfigIssue("data.path", DEMO_CORPUS_HINT))
    for key, value in sources:
        root = Path(value).expanduser()
        meta, issue = _read_metadata(key, root)
        if issue is not None or meta is None:
            out += [issue] if issue else []
            continue
        tokenizer = dict_of(meta["tokenizer"], "tokenizer")  # _read_metadata checked it is one
        where, raw = (
            ("vocab_size", meta["vocab_size"])
            if "vocab_size" in meta
            else ("tokenizer.vocab_size", tokenizer.get("vocab_size", 0))
        )
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < 2**63:
            out.append(
                ConfigIssue(
                    key,
                    f"{root / METADATA}: {where} is {str(raw)[:40]!r}, not a whole number of token ids: the prepared "
                    f"directory is damaged or was edited; prepare it again with `kforge prepare-data`",
                )
            )
            continue
        vocab = raw
        if vocab > s.model.vocab_size:
            name = "byte" if tokenizer.get("kind") == "byte" else tokenizer.get("file", TOKENIZER_FILE)
            out.append(
                ConfigIssue(
                    "model.vocab_size",
                    f"{s.model.vocab_size} is smaller than the {vocab} ids of the tokenizer ({name}) that {root} "
                    f"({key}) was prepared with: set --model.vocab_size={-(-vocab // 64) * 64}",
                )
            )
        tok_issue = _tokenizer_issue(key, root, tokenizer, s.data.tokenizer)
        if tok_issue is not None and tok_issue not in out:
            out.append(tok_issue)
    if s.eval.path and not Path(s.eval.path).expanduser().is_dir():
        out.append(ConfigIssue("eval.path", f"{s.eval.path} does not exist; create it with `kforge prepare-data`"))
    return out


def record_data_tokenizer(settings: JobSettings) -> None:
    """data.tokenizer = the prepared data's tokenizer.json, when the data was made with one.

    With the default ``"byte"`` the data's own tokenizer is used; writing its path into the
    run's config.toml says what the run really trained with.
    """
    if settings.data.tokenizer != "byte" or settings.vlm is not None:
        return
    roots = [settings.data.path] if settings.data.path else [d.path for d in settings.data.datasets[:1]]
    for value in roots:
        root = Path(value).expanduser()
        try:
            meta: object = json.loads(read_text_capped(root / METADATA, MAX_METADATA_BYTES, "metadata"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, InvalidInputError):
            return
        tokenizer = meta.get("tokenizer") if isinstance(meta, dict) else None
        if isinstance(tokenizer, dict) and tokenizer.get("kind") == "hf" and (root / TOKENIZER_FILE).is_file():
            settings.data.tokenizer = str((root / TOKENIZER_FILE).resolve())
