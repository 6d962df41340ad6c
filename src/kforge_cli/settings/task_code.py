"""The consent for task code: which Python an lm-eval task YAML would import, and the refusal without it.

An lm-eval task file's ``!function module.func`` tags make the harness import ``module`` when
it loads the YAML. Like ``train.hooks`` (:mod:`kforge_cli.settings.hook_policy`), code named by
a file runs only when ``--allow-hooks`` lists it: for ``kforge eval``, and for the evaluations
``eval.after_checkpoint`` starts (``kforge train``/``resume`` check them and pass the consent
on). The files are bounded (bytes, YAML nodes with aliases expanded, included files) and read
with a safe loader; nothing is imported here but the harness's own package, to find its task
folder (its YAMLs and their Python ship with it). Torch-free, so commands that only pass the
consent on (``--sbatch``, the resume line) load no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kforge_cli.common.files import read_text_capped
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings.hook_policy import refuse_unallowed_code

if TYPE_CHECKING:
    from kforge_cli.settings import JobSettings


MAX_TASK_YAML_BYTES = 1 << 20  # a task YAML is KBs
MAX_TASK_YAML_NODES = 100_000  # scalars and collections with every alias expanded (an honest task: hundreds)
MAX_TASK_YAML_FILES = 32  # the file and everything it includes


def _builtin_tasks_dir() -> Path | None:
    """The installed harness's own task folder (its YAMLs and their Python ship with the harness)."""
    try:
        import lm_eval.tasks
    except ImportError:
        return None
    return Path(lm_eval.tasks.__file__).resolve().parent


def _scan_yaml(path: Path, text: str) -> list[str]:
    """Bound one task YAML without building it; the ``!function`` references it holds, in order.

    Walks the parser's event stream (no object is built, no alias expanded) and counts the
    nodes the document would have with every alias expanded: an alias bomb (a few anchors
    each repeating the one before) is refused here, at a cost linear in the file's size.
    """
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    anchors: dict[str, int] = {}
    stack: list[list[Any]] = [[None, 0]]  # [anchor, expanded size so far] per open collection
    functions: list[str] = []
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.ScalarEvent | yaml.AliasEvent):
                if isinstance(event, yaml.AliasEvent):
                    if event.anchor not in anchors:
                        raise InvalidInputError(f"lm-eval task file {path}: alias *{event.anchor} has no anchor")
                    size = anchors[event.anchor]
                else:
                    size = 1
                    if event.tag == "!function" and event.value not in functions:
                        functions.append(event.value)
                    if event.anchor:
                        anchors[event.anchor] = size
                stack[-1][1] += size
            elif isinstance(event, yaml.CollectionStartEvent):
                stack.append([event.anchor, 1])
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, size = stack.pop()
                if anchor:
                    anchors[anchor] = size
                stack[-1][1] += size
            if stack[0][1] + sum(s for _, s in stack[1:]) > MAX_TASK_YAML_NODES:
                raise InvalidInputError(
                    f"lm-eval task file {path} expands to more than {MAX_TASK_YAML_NODES} YAML nodes (its aliases "
                    "repeat what they name): not a task file; refusing to load it"
                )
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"lm-eval task file {path} is not readable YAML ({exc})") from None
    return functions


def _includes(path: Path, text: str) -> list[Path]:
    """The files `path`'s ``include:`` names, resolved as the harness does (beside the file)."""
    import yaml

    class _Inert(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        pass

    _Inert.add_constructor("!function", lambda loader, node: None)  # never imported here
    try:
        config = yaml.load(text, Loader=_Inert)  # a safe loader; bounded by _scan_yaml
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"lm-eval task file {path} is not readable YAML ({exc})") from None
    include = config.get("include") if isinstance(config, dict) else None
    names = include if isinstance(include, list) else [] if include is None else [include]
    if not all(isinstance(n, str) for n in names):
        raise InvalidInputError(f"lm-eval task file {path}: `include` must name files")
    return [Path(n) if Path(n).is_absolute() else path.parent / n for n in names]


def task_code(path: str | Path) -> list[tuple[str, Path]]:
    """Check a task YAML and what it includes against the bounds above; the Python it names.

    Returns each ``!function module.func`` of a file outside the harness's own task folder
    with that file (the harness imports ``module`` from beside the file, or as an installed
    module, when it loads the YAML). Nothing is imported. Exit 2 for a missing, oversized,
    unreadable or bombed file.
    """
    builtin = _builtin_tasks_dir()
    todo, seen, found = [Path(path).expanduser()], set[Path](), list[tuple[str, Path]]()
    while todo:
        current = todo.pop(0)
        resolved = current.resolve()
        if resolved in seen:
            continue
        seen.add(resolved)
        if len(seen) > MAX_TASK_YAML_FILES:
            raise InvalidInputError(
                f"lm-eval task file {path} includes more than {MAX_TASK_YAML_FILES} files: refusing to load it"
            )
        try:
            text = read_text_capped(current, MAX_TASK_YAML_BYTES, "lm-eval task file")
        except FileNotFoundError:
            raise InvalidInputError(f"lm-eval task file {current} does not exist") from None
        except OSError as exc:
            raise InvalidInputError(f"cannot read lm-eval task file {current}: {exc.strerror or exc}") from None
        functions = _scan_yaml(current, text)
        if builtin is None or not resolved.is_relative_to(builtin):
            found += [(spec, current) for spec in functions]
        todo += _includes(current, text)
    return found


def refuse_unallowed_task_code(path: str | Path, allowed: list[str] | None) -> None:
    """Exit 2 unless ``--allow-hooks`` names every module the task file would import (see :func:`task_code`)."""
    found = task_code(path)
    if not found:
        return
    where = {}
    for spec, yaml_file in found:
        module = spec.rpartition(".")[0]
        local = yaml_file.parent / f"{module.replace('.', '/')}.py"
        where[spec] = f"{spec} ({local if local.exists() else 'an installed module'}, named by {yaml_file})"
    refuse_unallowed_code(
        [spec.rpartition(".")[0] + ":" + spec.rpartition(".")[2] for spec, _ in found],
        allowed,
        what=f"lm-eval task file {path} (its `!function` tags)",
        described=list(where.values()),
        command="kforge eval",
    )


def _yaml_tasks(tasks: Sequence[str]) -> list[str]:
    return [t[len("lm-eval:") :] for t in tasks if t.startswith("lm-eval:") and t.endswith((".yaml", ".yml"))]


def task_code_modules(tasks: Sequence[str]) -> list[str]:
    """The modules the lm-eval task files among ``tasks`` would import (``!function`` tags), each once."""
    files = _yaml_tasks(tasks)
    if not files:
        return []
    modules: list[str] = []
    for path in files:
        for spec, _ in task_code(path):
            module = spec.rpartition(".")[0]
            if module and module not in modules:
                modules.append(module)
    return modules


def consented_code(settings: JobSettings) -> list[str]:
    """What a later command on this run passes in ``--allow-hooks`` (the job script, a resume line, a
    local launch's children): the hooks and the eval.after_checkpoint task code, allowed when it started.
    Torch-free unless task files are named."""
    code = list(settings.train.hooks)
    if settings.eval.after_checkpoint:
        code += task_code_modules(settings.eval.after_checkpoint_tasks)
    return code


def refuse_unallowed_eval_code(settings: JobSettings, allow_hooks: list[str] | None, command: str) -> None:
    """Exit 2 unless ``--allow-hooks`` lists the Python every eval.after_checkpoint task file names
    (the evaluations it starts are given the same consent)."""
    if not settings.eval.after_checkpoint:
        return
    files = _yaml_tasks(settings.eval.after_checkpoint_tasks)
    if not files:
        return
    try:
        for path in files:
            refuse_unallowed_task_code(path, allow_hooks)
    except InvalidInputError as exc:
        raise InvalidInputError(f"eval.after_checkpoint_tasks: {exc}".replace("kforge eval", command)) from None
