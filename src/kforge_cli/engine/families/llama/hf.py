"""The Llama family's Hugging Face mapping (``ModelFamily.hf``): Llama, Qwen3 (dense with QK-norm)
and the MoE architectures of :mod:`.hf_moe`, both ways."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kforge_cli.common.json_values import int_of
from kforge_cli.engine.families.base import HFExport
from kforge_cli.engine.families.llama.hf_layout import Layout, LlamaExport, from_interleaved_rope
from kforge_cli.engine.families.llama.hf_moe import BY_MODEL_TYPE, EXPERT_BIAS, ROUTER_GATE, from_hf_moe_name
from kforge_cli.engine.families.llama.hf_names import export_problems, from_hf_name, model_fields_from_hf
from kforge_cli.errors import CheckpointError
from kforge_cli.settings.training import ModelSettings

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports carry; recomputed from the config
FUSED_GATE = "feed_forward.experts.w1"
FUSED_UP = "feed_forward.experts.w3"


class LlamaHF:
    """Export to ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / the MoE classes; import from them."""

    model_types: tuple[str, ...] = ("llama", "qwen3", *BY_MODEL_TYPE)

    def export_problems(self, fields: dict[str, object]) -> list[str]:
        return export_problems(fields)

    def exporter(self, fields: dict[str, object], cfg: ModelSettings) -> HFExport:
        return LlamaExport(Layout.of(fields), fields, cfg)

    def model_fields(self, config: dict[str, object]) -> dict[str, object]:
        return model_fields_from_hf(config)

    def read_tensors(
        self, config: dict[str, object], files: Sequence[Path], wanted: set[str] | None, where: Path
    ) -> dict[str, torch.Tensor]:
        return read_llama_tensors(config, files, wanted, where)


def read_llama_tensors(
    config: dict[str, object], files: Sequence[Path], wanted: set[str] | None, hf_dir: Path
) -> dict[str, torch.Tensor]:
    """kforge name -> CPU tensor for every (or every wanted) weight in the directory's safetensors.

    Llama / Qwen3 names map one to one; MoE experts written per expert are stacked into
    kforge's ``[E, out, in]`` (a fused ``gate_up_proj`` is split), the selection bias is
    read from wherever the architecture keeps it (zeros for Qwen3-MoE, which has none),
    and ERNIE's interleaved-RoPE ``q_proj``/``k_proj`` rows are put back in kforge's order.
    """
    from safetensors import SafetensorError, safe_open

    arch = BY_MODEL_TYPE.get(str(config.get("model_type")))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    unknown: list[str] = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        if wanted is None or name in wanted:
            out[name] = tensor

    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    plain = from_hf_name(key)
                    moe = None if plain is not None else from_hf_moe_name(key)
                    if plain is not None:
                        keep(plain, f.get_tensor(key))
                    elif moe is None:
                        if not key.endswith(_IGNORED_SUFFIXES):
                            unknown.append(key)
                    elif moe.fused:  # gate_up_proj [E, 2 x hidden, dim]: w1 over w3
                        gate, up = f.get_tensor(key).chunk(2, dim=1)
                        keep(moe.name, gate.contiguous())
                        keep(moe.name.removesuffix(FUSED_GATE) + FUSED_UP, up.contiguous())
                    elif moe.expert is not None:
                        if wanted is None or moe.name in wanted:
                            experts.setdefault(moe.name, {})[moe.expert] = f.get_tensor(key)
                    elif moe.name.endswith(EXPERT_BIAS):
                        keep(moe.name, f.get_tensor(key).reshape(-1).float())
                    else:
                        keep(moe.name, f.get_tensor(key))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
    for name, parts in experts.items():
        if sorted(parts) != list(range(len(parts))):
            raise CheckpointError(f"{hf_dir}: the experts of {name} are not numbered 0..{len(parts) - 1}")
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    for name in [n for n in out if n.endswith(ROUTER_GATE)]:  # an architecture without a selection bias: zero
        bias = name.removesuffix(ROUTER_GATE) + EXPERT_BIAS
        if bias not in out and (wanted is None or bias in wanted):
            out[bias] = torch.zeros(out[name].shape[0], dtype=torch.float32)
    if arch is not None and arch.interleaved_rope:
        n_heads = int_of(config["num_attention_heads"])
        kv_heads = int_of(config.get("num_key_value_heads") or n_heads)
        for name in out:
            if name.endswith("attention.wq.weight"):
                out[name] = from_interleaved_rope(out[name], n_heads)
            elif name.endswith("attention.wk.weight"):
                out[name] = from_interleaved_rope(out[name], kv_heads)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise CheckpointError(f"{hf_dir} holds tensors a kforge model has no place for: {shown}")
    return out


HF = LlamaHF()
