"""What the GPU machine must hold: the third-party distributions kforge's GPU run imports.

The import closure, read statically (``ast``) from the source:

- every module of ``kforge_cli`` (``kforge train`` and the cases call into most of it),
  all of its imports, including function-local ones;
- the acceptance scripts (bench/gpu/acceptance.py, bench/attention_speed.py), all imports;
- every test module's module-level imports (``pytest -m gpu tests`` collects them all),
  and all imports of the gpu-marked test modules, conftest and the helpers they launch.

Imports under ``if TYPE_CHECKING:`` or in a ``try`` that catches ImportError are left out
(they are optional by construction), as are the features named in :data:`OPTIONAL`, which
the GPU cases never turn on. Each remaining top-level module maps to its distribution,
then the requirements of every carried wheel are added (the image's own packages come
with theirs). :func:`missing` is what neither the image list nor the wheel list holds.

    python bench/gpu/closure.py      # prints the needed distributions and what is missing
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Imported only by features the GPU run never uses: distribution -> where kforge uses it.
OPTIONAL = {
    "wandb": "metrics.backends = ['wandb']",
    "mlflow": "metrics.backends = ['mlflow']",
    "lm-eval": "kforge eval --task lm-eval:NAME (extra 'lm-eval')",
}
# Import names whose distribution differs and which may not be installed where this runs.
KNOWN = {"lm_eval": "lm-eval", "PIL": "pillow", "yaml": "pyyaml", "dotenv": "python-dotenv"}
OWN = {"kforge_cli", "tests", "bench", "__future__"}


def norm(name: str) -> str:
    """A distribution name in PEP 503 form (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> dict[str, str | None]:
    """``name`` / ``name==version`` lines (comments and blanks ignored) -> {normalised name: version}."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version.strip() or None
    return out


def _optional_try(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(n, ast.Name) and n.id in {"ImportError", "ModuleNotFoundError"} for n in names):
            return True
    return False


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, module_level_only: bool = False) -> list[str]:
    return _imports(path, path.stat().st_mtime_ns, module_level_only)


@functools.cache
def _imports(path: Path, _mtime: int, module_level_only: bool) -> list[str]:
    """Top-level names of the absolute imports in `path` (see the module docstring for what is skipped)."""
    tree = ast.parse(path.read_text(), str(path))

    def visit(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.module.split(".")[0]
        elif isinstance(node, ast.Try) and _optional_try(node):
            return
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from (n for child in node.orelse for n in visit(child))
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and module_level_only:
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    return list(visit(tree))


def gpu_test_modules(tests: Path) -> list[Path]:
    return sorted(p for p in tests.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def import_names(repo: Path = REPO) -> set[str]:
    """Third-party top-level module names of the GPU run's closure (stdlib and kforge's own left out)."""
    tests = repo / "tests"
    full: list[Path] = [*sorted((repo / "src" / "kforge_cli").rglob("*.py"))]
    full += [repo / "bench" / "gpu" / "acceptance.py", repo / "bench" / "attention_speed.py"]
    full += [tests / "conftest.py", *sorted((tests / "helpers").glob("*.py")), *gpu_test_modules(tests)]
    full += [tests / "distributed" / "parity.py"]  # tests/helpers/ (ranks.py, launch.py) are in the list above
    collected = sorted(set(tests.rglob("*.py")) - set(full))
    names = {n for p in full for n in imports(p)} | {n for p in collected for n in imports(p, True)}
    return {n for n in names if n not in sys.stdlib_module_names and n not in OWN}


@functools.cache
def _import_to_dists() -> dict[str, list[str]]:
    return md.packages_distributions()


def distribution_of(name: str) -> str:
    found = [norm(d) for d in _import_to_dists().get(name, [])]
    if norm(name) in found or not found:  # `mlflow` is also in mlflow-skinny: the namesake wins
        return norm(KNOWN.get(name, name))
    return found[0]


def _requirements(dist: str) -> Iterator[tuple[str, str]]:
    """(requirement name, specifier) of an installed distribution for Linux, CPython 3.12, no extras."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
    env |= {"platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
    try:
        specs = md.requires(dist) or []
    except md.PackageNotFoundError:
        return
    for spec in specs:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate(env):
            yield norm(req.name), str(req.specifier)


def needed(image: Iterable[str], wheels: dict[str, str | None], repo: Path = REPO) -> tuple[set[str], list[str]]:
    """The distributions the GPU run needs (optional ones left out), and version conflicts of the wheel pins.

    A conflict: a pin that does not satisfy a requirement on it from a carried wheel (read from the
    installed distribution of the same version here) or from kforge's pyproject."""
    import tomllib

    from packaging.requirements import Requirement

    dists = {distribution_of(n) for n in import_names(repo)} - set(OPTIONAL)
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    reqs = [(norm(r.name), str(r.specifier), "pyproject") for r in map(Requirement, project["dependencies"])]
    image_set = set(image)
    todo = [d for d in dists if d in wheels]
    while todo:
        dist = todo.pop()
        try:
            same = md.version(dist) == wheels.get(dist)
        except md.PackageNotFoundError:
            same = False
        if not same:
            continue  # only a pinned version's own metadata says what it needs
        for name, spec in _requirements(dist):
            reqs.append((name, spec, dist))
            if name not in dists:
                dists.add(name)
                if name in wheels and name not in image_set:
                    todo.append(name)
    conflicts = []
    for name, spec, by in reqs:
        pin = wheels.get(name)
        if pin and spec and not Requirement(f"{name}{spec}").specifier.contains(pin, prereleases=True):
            conflicts.append(f"{name}=={pin} does not satisfy {name}{spec} (required by {by})")
    return dists, conflicts


def missing(image: Iterable[str], wheels: dict[str, str | None], repo: Path = REPO) -> list[str]:
    """Needed distributions in neither list."""
    image_set, dists = set(image), needed(image, wheels, repo)[0]
    return sorted(d for d in dists if d not in image_set and d not in wheels)


def main() -> int:
    image, wheels = read_list(HERE / "image-packages.txt"), read_list(HERE / "wheels.txt")
    dists, conflicts = needed(image, wheels)
    for d in sorted(dists):
        where = "wheel" if d in wheels else "image" if d in image else "MISSING"
        print(f"{d:<24}{where}")
    print("optional, not carried:", ", ".join(f"{k} ({v})" for k, v in OPTIONAL.items()))
    for c in conflicts:
        print("CONFLICT", c)
    return 1 if conflicts or missing(image, wheels) else 0


if __name__ == "__main__":
    sys.exit(main())
