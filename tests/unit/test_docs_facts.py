"""The docs tell the truth about what ships: the VLM data formats the code accepts (docs/data.md),
every benchmark script (docs/benchmarks.md).

Every profile in the configuration reference: tests/unit/test_docs_reference.py; the README's
example commands run: tests/e2e/test_readme_examples.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kforge_cli.engine.data.vlm.media import IMAGE_SUFFIXES
from kforge_cli.engine.data.vlm.pair_sources import resolve_records

ROOT = Path(__file__).parents[2]
DATA_PAGE = (ROOT / "docs" / "data.md").read_text()


def test_the_vlm_data_formats_the_docs_show_are_the_ones_the_code_accepts(tmp_path: Path) -> None:
    section = DATA_PAGE[DATA_PAGE.index("## Image and video data for VLMs") :].split("\n### ")[0]
    examples = [json.loads(m) for m in re.findall(r"`(\{\"(?:image|video)\".*?\})`", section)]
    assert {next(iter(e)) for e in examples} == {"image", "video"}
    lines = [json.dumps(e) for e in examples]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    _, train, val = resolve_records(str(tmp_path))
    assert [(r.kind, r.path) for r in train] == [(next(iter(e)), tmp_path / next(iter(e.values()))) for e in examples]
    assert val is None
    listed = re.search(r"a scanned directory counts `([^`]+)`", section.replace("\n", " "))
    assert listed is not None and tuple(listed.group(1).split()) == IMAGE_SUFFIXES
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "cat.png").write_bytes(b"")
    (tmp_path / "dir" / "cat.txt").write_text("a cat\n")
    (tmp_path / "dir" / "clip7").mkdir()
    (tmp_path / "dir" / "clip7.txt").write_text("a clip\n")
    _, pairs, _ = resolve_records(str(tmp_path / "dir"))
    assert [(r.kind, r.path.name, r.caption) for r in pairs] == [
        ("image", "cat.png", "a cat"),
        ("video", "clip7", "a clip"),
    ]


def test_every_benchmark_script_is_on_the_benchmarks_page() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = {p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh")} - {"bare_typer_app.py"}
    assert scripts, "no bench scripts found"
    missing = sorted(name for name in scripts if f"`{name}`" not in page)
    assert not missing, f"add to docs/benchmarks.md: {missing}"


def test_the_exit_code_table_lists_every_code_kforge_exits_with() -> None:
    from kforge_cli import errors

    constants = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    for page in (ROOT / "README.md", ROOT / "docs" / "resilience.md"):
        table = {int(code) for code in re.findall(r"^\| (\d+) \|", page.read_text(), flags=re.M)}
        assert constants | {130} == table, page.name
