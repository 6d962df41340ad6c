"""Counts of the engine's shape (issue 39): how much of the code sees the whole settings object.

Prints: parameters annotated ``JobSettings`` in ``src/kforge_cli/engine/``, file names used twice
or more in ``src/`` (``__init__.py`` aside), the lines of ``engine/train/loop.py:_train``, the
``ast.Name`` nodes with id ``Any`` in ``src/``, and the largest file and function (in lines).

    python tools/count_shape.py
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ENGINE = SRC / "kforge_cli" / "engine"
Function = ast.FunctionDef | ast.AsyncFunctionDef


def _names(annotation: ast.expr | None) -> set[str]:
    """Every bare or dotted name in an annotation, string annotations parsed."""
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return set()
    out: set[str] = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not annotation:
            out |= _names(node)
    return out


def _functions(tree: ast.AST) -> list[Function]:
    return [n for n in ast.walk(tree) if isinstance(n, Function)]


def _params(fn: Function) -> list[ast.arg]:
    a = fn.args
    extra = [x for x in (a.vararg, a.kwarg) if x is not None]
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *extra]


def _lines(fn: Function) -> int:
    return (fn.end_lineno or fn.lineno) - fn.lineno + 1


def main() -> None:
    files = sorted(SRC.rglob("*.py"))
    trees = {f: ast.parse(f.read_text(), filename=str(f)) for f in files}
    job_params = sum(
        "JobSettings" in _names(p.annotation)
        for f, tree in trees.items()
        if ENGINE in f.parents
        for fn in _functions(tree)
        for p in _params(fn)
    )
    names = Counter(f.name for f in files if f.name != "__init__.py")
    repeated = sorted(n for n, c in names.items() if c > 1)
    any_names = sum(isinstance(n, ast.Name) and n.id == "Any" for tree in trees.values() for n in ast.walk(tree))
    loop = ENGINE / "train" / "loop.py"
    train_lines = max(
        (_lines(fn) for fn in _functions(trees.get(loop, ast.Module(body=[], type_ignores=[]))) if fn.name == "_train"),
        default=0,
    )
    sizes = {f: len(f.read_text().splitlines()) for f in files}
    big_file = max(sizes, key=lambda f: sizes[f])
    big_fn_lines, big_fn = max(
        (_lines(fn), f"{f.relative_to(SRC)}:{fn.name}") for f, t in trees.items() for fn in _functions(t)
    )
    print(f"JobSettings-annotated params in engine/: {job_params}")
    print(f"repeated file names in src/ (excluding __init__.py): {len(repeated)} ({', '.join(repeated)})")
    print(f"lines of engine/train/loop.py:_train: {train_lines}")
    print(f"ast.Name with id Any in src/: {any_names}")
    print(f"largest file: {big_file.relative_to(SRC)} ({sizes[big_file]} lines)")
    print(f"largest function: {big_fn} ({big_fn_lines} lines)")


if __name__ == "__main__":
    main()
