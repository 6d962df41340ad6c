"""Which family's Hugging Face mapping a saved model uses, and what it cannot export."""

from __future__ import annotations

from kforge_cli.engine.families.base import ModelFamily
from kforge_cli.engine.families.registry import DEFAULT_FAMILY, get_family


def family_of_fields(fields: dict[str, object]) -> ModelFamily:
    """The family of a saved model config (``model.family``; runs before families existed: the default)."""
    return get_family(str(fields.get("family") or DEFAULT_FAMILY))


def export_problems(fields: dict[str, object], has_vlm: bool = False) -> list[str]:
    """What no Hugging Face architecture of the model's family can hold (empty: exportable)."""
    family = family_of_fields(fields)
    problems = []
    if has_vlm:
        problems.append("it is a vision-language / MoT model; only text models export to LlamaForCausalLM")
    if family.hf is None:
        return [*problems, f"model family {family.name!r} has no Hugging Face mapping"]
    return problems + family.hf.export_problems(fields)
