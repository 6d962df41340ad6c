"""Building `JobSettings` from its layered sources, remembering where each value came from.

Precedence, lowest to highest: defaults < profile < ``--config FILE.toml`` <
environment ``KFORGE_SECTION__KEY`` < command line ``--section.key=value``.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import tomllib
import types
import typing
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import EnvSettingsSource

from kforge_cli.errors import ConfigError, ConfigIssue, InvalidInputError
from kforge_cli.settings.job import JobSettings, without_environment
from kforge_cli.settings.profiles import (
    DEFAULT_PROFILE,
    ENV_PATH,
    ProfileFile,
    deep_merge,
    load_profile,
    profile_chain,
    read_toml,
)


@dataclass
class ResolvedSettings:
    """Validated settings plus the source of every value that is not a default."""

    settings: JobSettings
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[ConfigIssue] = field(default_factory=list)  # allowed but probably unintended
    profile_files: list[ProfileFile] = field(default_factory=list)  # the profile, then what it extends

    def profile_origin(self) -> list[str]:
        """Where each profile file came from, one line each.

        Empty without a profile layer, and when every file is one kforge ships (the
        default everyone expects); any local, $KFORGE_PROFILE_PATH or given file is named.
        """
        from kforge_cli.settings.profiles import SHIPPED

        if all(e.source == SHIPPED for e in self.profile_files):
            return []
        lines = []
        for i, entry in enumerate(self.profile_files):
            what = f"profile {entry.name}" if i == 0 else f"  extends {entry.name}"
            lines.append(f"{what}: {entry.describe()}")
        return lines

    def source_of(self, dotted: str) -> str:
        """Where the value at `dotted` came from (the key itself or an enclosing one)."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            hit = self.sources.get(".".join(parts[:i]))
            if hit:
                return hit
        prefix = dotted + "."
        if any(k.startswith(prefix) for k in self.sources):
            return "several sources (see the keys below it)"
        return "default"


def parse_override_value(raw: str) -> object:
    """A command-line value in TOML syntax (numbers, booleans, lists, inline tables), else a string.

    TOML dates and times (e.g. a SLURM time limit `01:00:00`) stay strings: no setting
    is a datetime, and a user typing one means the text.
    """
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    return raw if isinstance(value, datetime.date | datetime.time) else value


def parse_overrides(args: list[str]) -> list[tuple[str, object]]:
    """`--section.key=value` or `--section.key value` pairs, in order."""
    pairs: list[tuple[str, object]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise InvalidInputError(
                f"unexpected argument {arg!r}: overrides look like --section.key=value (e.g. --model.dim=512)"
                + _did_you_mean(arg)
            )
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = arg[2:], args[i + 1]
            i += 1
        else:
            raise InvalidInputError(f"override {arg} has no value: write {arg}=VALUE")
        try:
            value = parse_override_value(raw)
        except (ValueError, RecursionError) as exc:  # a number of > 4300 digits; a value nested thousands deep
            why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
            raise InvalidInputError(f"override --{key}: its value is not usable ({why}); give a plain value") from None
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def _did_you_mean(arg: str) -> str:
    """``; did you mean --optimizer.lr=1e-3?`` for a bare ``--learning_rate=1e-3`` (a key without its section)."""
    if not arg.startswith("--"):
        return ""
    name, sep, raw = arg[2:].partition("=")
    key = suggest_key([name.replace("-", "_")]) if name else None
    return f"; did you mean --{key}{sep}{raw}?" if key else ""


def nest(dotted: str, value: object) -> dict[str, object]:
    """'a.b.c', v -> {'a': {'b': {'c': v}}}."""
    *parents, leaf = dotted.split(".")
    out: dict[str, object] = {leaf: value}
    for part in reversed(parents):
        out = {part: out}
    return out


def leaf_paths(data: dict[str, object], prefix: str = "") -> list[str]:
    """Dotted paths of the non-dict values of a nested dict."""
    paths: list[str] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            paths += leaf_paths(value, path + ".")
        else:
            paths.append(path)
    return paths


def load_settings(
    profile: str | None = None,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    use_env: bool = True,
    base: dict[str, object] | None = None,
    base_source: str = "saved config",
    for_run: bool = False,
) -> ResolvedSettings:
    """Resolve and validate settings from every source; raise ConfigError listing all problems.

    `base`, when given, replaces the profile layer (used by `kforge resume` with a run's
    saved config.toml). `for_run` (train, resume, validate-config, --sbatch) also resolves
    relative paths to absolute ones, records the prepared data's tokenizer, and checks the
    data on disk against the model (settings.data_check), in the same pass as the rules.
    """
    layers: list[tuple[str, dict[str, object]]] = []
    chain: list[ProfileFile] = []
    if base is not None:
        layers.append((base_source, base))
    else:
        name = profile or DEFAULT_PROFILE
        data, path = load_profile(name)  # refuses a ./profiles file shadowing a shipped profile
        chain = profile_chain(name)
        data = {"profile": name, **data}
        named_by_path = name.endswith(".toml") or "/" in name  # its source once: the path typed
        layers.append((f"profile {name}" if named_by_path else f"profile {name} ({path})", data))
    if config is not None:
        layers.append((f"config {config}", read_toml(Path(config), "config file")))
    if use_env:
        env = EnvSettingsSource(JobSettings)()
        for path in leaf_paths(env):
            value = _env_value(path, _get(env, path))
            layers.append((f"env KFORGE_{path.upper().replace('.', '__')}", nest(path, value)))
    for key, value in parse_overrides(overrides or []):
        layers.append((f"command line --{key}", nest(key, value)))

    merged: dict[str, object] = {}
    sources: dict[str, str] = {}
    for source, data in layers:
        merged = deep_merge(merged, data)
        for path in leaf_paths(data):
            for existing in [k for k in sources if k.startswith(path + ".")]:
                del sources[existing]
            sources[path] = source

    from kforge_cli.settings.rules import config_warnings
    from kforge_cli.settings.shrink import shrink_warnings  # builds on the rules: asked beside them, not by them

    try:
        with nullcontext() if use_env else without_environment():  # use_env=False: not even JobSettings' own read
            settings = JobSettings.model_validate(merged)
    except ValidationError as exc:
        errors = exc.errors()
        problems = [_issue_from_pydantic(err, sources) for err in errors]
        with nullcontext() if use_env else without_environment():
            rest = _validate_without(merged, [err["loc"] for err in errors])  # the rules, in the same report
        if rest is not None:
            reported = {p.path for p in problems}
            problems += [p for p in _rule_issues(rest, for_run) if p.path not in reported]
        raise ConfigError(problems) from None
    problems = _rule_issues(settings, for_run)
    if problems:
        raise ConfigError(problems)
    warnings = [
        ConfigIssue("profile", f"{e.path} from {ENV_PATH} SHADOWS the shipped profile {e.name} ({e.shadows_shipped})")
        for e in chain
        if e.shadows_shipped is not None and e.source == ENV_PATH
    ]
    return ResolvedSettings(settings, sources, warnings + config_warnings(settings) + shrink_warnings(settings), chain)


def _rule_issues(settings: JobSettings, for_run: bool) -> list[ConfigIssue]:
    from kforge_cli.settings.rules import config_issues

    problems = config_issues(settings)
    if for_run:
        from kforge_cli.settings.data_check import data_issues, make_paths_absolute, record_data_tokenizer
        from kforge_cli.settings.tracking_check import tracking_issues

        make_paths_absolute(settings)
        record_data_tokenizer(settings)
        problems += data_issues(settings)
        problems += tracking_issues(settings.metrics)
    return problems


def _validate_without(merged: dict[str, object], locs: list[tuple[int | str, ...]]) -> JobSettings | None:
    """The settings with every invalid value dropped (back to its default), if that validates."""
    data = copy.deepcopy(merged)
    for loc in locs:
        node: object = data
        for part in loc[:-1]:
            node = _child(node, part)
        key = loc[-1] if loc else None
        if isinstance(node, dict) and isinstance(key, str) and key in node:  # TOML keys are strings
            del node[key]
    try:
        return JobSettings.model_validate(data)
    except ValidationError:
        return None


def _child(node: object, part: int | str) -> object:
    """``node[part]`` for a dict key or a list index that is there, else None."""
    if isinstance(node, dict) and isinstance(part, str):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
        return node[part]
    return None


def _env_value(dotted: str, value: object) -> object:
    """An environment variable's text as the integer an integer field needs (``KFORGE_TRAIN__MAX_STEPS=100``);
    a TOML file or the command line gives the integer itself, and a quoted one there is refused."""
    from kforge_cli.settings.section import is_int_field

    loc = dotted.split(".")
    model = _model_at(loc[:-1])
    info = model.model_fields.get(loc[-1]) if model is not None else None
    if isinstance(value, str) and info is not None and is_int_field(info.annotation):
        try:
            return int(value.strip())
        except ValueError:
            return value  # refused by the field, naming the variable
    return value


def _get(data: dict[str, object], dotted: str) -> object:
    node: object = data
    for part in dotted.split("."):
        assert isinstance(node, dict), dotted  # leaf_paths only names paths through dicts
        node = node[part]
    return node


def _issue_from_pydantic(err: ErrorDetails, sources: dict[str, str]) -> ConfigIssue:
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    if err["type"] == "extra_forbidden":
        hint = suggest_key(loc)
        where = sources.get(path) or next((v for k, v in sources.items() if k.startswith(path + ".")), None)
        message = "unknown key" + (f" (from {where})" if where else "")
        return ConfigIssue(path, message + (f"; did you mean {hint}?" if hint else ""))
    value = err.get("input")
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**40
        else f"{str(value)[:20]}... ({len(str(value))} digits)"
    )
    shown = f" (got {text if len(text) <= 200 else text[:200] + '...'})" if not isinstance(value, dict | list) else ""
    where = sources.get(path)
    origin = f" [from {where}]" if where else ""
    if (
        err["type"] in ("tuple_type", "list_type") and isinstance(value, str) and "," in value
    ):  # --optimizer.betas=0.9,0.95
        origin += f"; write a list in brackets: --{path}=[{value.strip('()')}]"
    return ConfigIssue(path, f"{err['msg']}{shown}{origin}")


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    """The settings model class that holds the fields at `loc` (a list of names/indices)."""
    model: type[BaseModel] = JobSettings
    for part in loc:
        if part.isdigit():
            continue
        info = model.model_fields.get(part)
        if info is None:
            return None
        inner = _section_class(info.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _section_class(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple, dict):
        for arg in typing.get_args(annotation):
            found = _section_class(arg)
            if found is not None:
                return found
    return None


def all_keys() -> list[str]:
    """Every dotted settings key (sections' fields), for suggestions and --explain."""
    keys: list[str] = []
    for name, info in JobSettings.model_fields.items():
        section = _section_class(info.annotation)
        if section is None:
            keys.append(name)
            continue
        keys += [f"{name}.{sub}" for sub in section.model_fields]
    return keys


# Names other trainers (and papers) use for kforge's keys: the leaf name, lower case.
ALIASES = {
    "learning_rate": "optimizer.lr",
    "lr": "optimizer.lr",
    "max_lr": "optimizer.lr",
    "warmup": "scheduler.warmup_steps",
    "warmup_iters": "scheduler.warmup_steps",
    "num_warmup_steps": "scheduler.warmup_steps",
    "lr_scheduler": "scheduler.name",
    "lr_scheduler_type": "scheduler.name",
    "min_lr": "scheduler.min_lr_ratio",
    "max_iters": "train.max_steps",
    "total_steps": "train.max_steps",
    "num_steps": "train.max_steps",
    "steps": "train.max_steps",
    "micro_batch_size": "train.batch_size",
    "per_device_train_batch_size": "train.batch_size",
    "batch": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "grad_accum": "train.grad_accum_steps",
    "max_grad_norm": "train.grad_clip_norm",
    "grad_clip": "train.grad_clip_norm",
    "clip_grad_norm": "train.grad_clip_norm",
    "block_size": "train.seq_len",
    "context_length": "train.seq_len",
    "seq_length": "train.seq_len",
    "max_seq_length": "train.seq_len",
    "sequence_length": "train.seq_len",
    "precision": "train.mixed_precision",
    "dtype": "train.mixed_precision",
    "output_dir": "train.run_dir",
    "out_dir": "train.run_dir",
    "hidden_size": "model.dim",
    "d_model": "model.dim",
    "n_embd": "model.dim",
    "num_layers": "model.n_layers",
    "n_layer": "model.n_layers",
    "num_hidden_layers": "model.n_layers",
    "num_heads": "model.n_heads",
    "n_head": "model.n_heads",
    "num_attention_heads": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads",
    "num_kv_heads": "model.n_kv_heads",
    "intermediate_size": "model.ffn_hidden_dim",
    "vocab": "model.vocab_size",
    "dataset": "data.path",
    "data_dir": "data.path",
    "data_path": "data.path",
    "train_data": "data.path",
    "tokenizer_path": "data.tokenizer",
    "save_interval": "checkpoint.interval",
    "save_steps": "checkpoint.interval",
    "ckpt_interval": "checkpoint.interval",
    "eval_interval": "eval.interval",
    "eval_steps": "eval.interval",
    "log_interval": "metrics.log_interval",
    "logging_steps": "metrics.log_interval",
}


def suggest_key(loc: list[str]) -> str | None:
    """The likeliest valid key for an unknown one, searching every section.

    In order: the same name in another section (`[optimizer] warmup_steps` ->
    scheduler.warmup_steps), a common alias (`learning_rate` -> optimizer.lr), a near
    spelling in the same section, a near spelling of any key's name, of any dotted key.
    """
    keys = all_keys()
    name = loc[-1]
    full = ".".join(loc)
    elsewhere = [k for k in keys if k.rsplit(".", 1)[-1] == name and k != full]
    if elsewhere:
        return elsewhere[0]
    alias = ALIASES.get(name.lower())
    if alias is not None and alias != full:
        return alias
    parent = _model_at(loc[:-1])
    prefix = ".".join(loc[:-1])
    if parent is not None:
        close = difflib.get_close_matches(name, list(parent.model_fields), n=1, cutoff=0.6)
        if close:
            return f"{prefix}.{close[0]}" if prefix else close[0]
    leaves: dict[str, str] = {}
    for key in keys:
        leaves.setdefault(key.rsplit(".", 1)[-1], key)
    close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.75)
    if close:
        return leaves[close[0]]
    close = difflib.get_close_matches(full, keys, n=1, cutoff=0.6)
    return close[0] if close else None
