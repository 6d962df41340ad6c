"""Op-level selective activation checkpointing keeps its saved matmuls under torch.compile.

What the policy decides shows in the backward: every matmul whose output was recomputed
runs again there. The backward's matmul count of a compiled block must equal eager's
(the gradients' own matmuls only), and be below full checkpointing's. The compiled case
uses ``aot_eager_decomp_partition``: Inductor's decompositions and its min-cut
partitioner (the part that honours the policy), with the graphs run op by op so a
dispatch mode can count them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kforge_cli.engine.families.llama import Transformer
from kforge_cli.engine.parallel.activation_checkpoint import apply_activation_checkpointing
from kforge_cli.settings import load_settings

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "overloadpacket", None) in _MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(ac: list[str], compiled: bool) -> int:
    s = load_settings(
        overrides=["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.vocab_size=128", *ac]
    ).settings
    torch.manual_seed(0)
    model = Transformer(s.model)
    apply_activation_checkpointing(model, s.train)
    if compiled:
        torch._dynamo.reset()
        for block in model.layers.values():
            block.compile(backend="aot_eager_decomp_partition", fullgraph=True)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1]).float().logsumexp(-1).mean()
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count


SELECTIVE_OP = ["--train.activation_checkpointing=selective", "--train.ac_selective_mode=op"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_selective_op_ac_recomputes_no_matmul(compiled: bool) -> None:
    none = _backward_matmuls([], compiled=False)  # the gradients' matmuls, nothing recomputed
    full = _backward_matmuls(["--train.activation_checkpointing=full"], compiled=False)
    got = _backward_matmuls(SELECTIVE_OP, compiled=compiled)
    assert full > none  # guards the counter: full AC recomputes the block's matmuls
    assert got == none, (
        f"selective op AC ({'compiled' if compiled else 'eager'}): {got} matmuls in backward, {none} without AC, {full} with full AC"
    )
