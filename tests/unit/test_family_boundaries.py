"""parallel/, plan/, interop/ and the FLOPs count name no model family's modules (issue 43).

They consume the ``ModelFamily`` interface (``engine/families/base.py``); a family's module
names live in its own package. Two checks: no source line (code, strings, docstrings or
comments) of those packages says a Llama module name as a word, and no module there imports a
family package (only ``families.base`` and ``families.registry``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kforge_cli

ENGINE = Path(kforge_cli.__file__).parent / "engine"
CONSUMERS = [ENGINE / "parallel", ENGINE / "plan", ENGINE / "interop", ENGINE / "model" / "flops.py"]
# The Llama family's module names (families/llama/model.py, engine/model/block.py): its own business.
FAMILY_NAMES = [
    "wq",
    "wk",
    "wv",
    "wo",
    "w1",
    "w2",
    "w3",
    "feed_forward",
    "tok_embeddings",
    "attention_norm",
    "ffn_norm",
    "q_norm",
    "k_norm",
    "shared_experts",
    "rope_cos",
    "rope_sin",
    "Transformer",
    "TransformerBlock",
    "wte",
    "wpe",
    "ln_1",
    "ln_2",
]
WORD = re.compile(r"\b(" + "|".join(FAMILY_NAMES) + r")\b")
ALLOWED_FAMILY_MODULES = {"kforge_cli.engine.families.base", "kforge_cli.engine.families.registry"}


def _sources() -> list[Path]:
    files: list[Path] = []
    for root in CONSUMERS:
        files.extend([root] if root.is_file() else sorted(root.rglob("*.py")))
    assert len(files) > 20, files  # the packages are where this test thinks they are
    return files


def test_consumers_name_no_family_module() -> None:
    hits = [
        f"{path.relative_to(ENGINE)}:{n}: {line.strip()}"
        for path in _sources()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if WORD.search(line)
    ]
    assert not hits, "family module names outside engine/families:\n" + "\n".join(hits)


def test_consumers_import_no_family_package() -> None:
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                family_module = name.startswith("kforge_cli.engine.families.")
                if family_module and not any(name.startswith(ok) for ok in ALLOWED_FAMILY_MODULES):
                    bad.append(f"{path.relative_to(ENGINE)}:{node.lineno}: {name}")
    assert not bad, "imports of a family package outside engine/families:\n" + "\n".join(bad)


def test_the_check_sees_a_family_name() -> None:
    """The pattern is live: the Llama family's own model does say these names."""
    model = (ENGINE / "families" / "llama" / "plans.py").read_text()
    assert WORD.search(model)
