"""The MoE step under pipeline parallelism: aux-loss gradients inside the schedule, balancing after it.

The schedule computes the loss on the last stage only, and each stage runs each
micro-batch's forward and backward separately, so the routers' aux losses cannot be
added to the loss as the plain MoE step does (`engine.train.moe_step`). Instead a
forward hook on every MoE layer wraps the layer's output in `_AuxLossGradient`: the
output passes through unchanged, and its backward also gives the layer's aux loss the
gradient it gets in the plain step, ``valid tokens of the micro-batch x the step's
scale`` (the `TokenNormaliser`'s ``loss_ranks / global valid tokens``). Every stage's
MoE layers therefore train exactly as on one process, whatever the schedule.

Which micro-batch a forward belongs to: every torch schedule runs a stage's forwards in
micro-batch order, so the hook counts a layer's forwards within the step. It counts only
training forwards outside the autograd engine (the recompute of activation checkpointing
runs inside it and is neither counted nor wrapped again; the original forward's wrapper
is the one in the graph). At the first step, and after each evaluation, the schedule
first runs one forward per stage on stand-in activations to infer shapes
(`training_step_infers_metadata`; under no_grad in torch 2.11, with grad in 2.13); the
hook leaves that forward unwrapped and clears the token counts it made, so it is neither
a micro-batch nor load.

After the schedule, `finish_moe_step` all-reduces the counts over the stage's
data-parallel ranks (EP included) and updates the biases, as in the plain MoE step.
Its metrics exist only on the stage that holds the layer, and the logging rank holds
the first stage: they are summed over the pipeline group into one vector with a slot
per MoE layer of the whole model, on the device, so no host read is added to a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kforge_cli.engine.model.moe import MoEFeedForward, finish_moe_step, moe_layers
from kforge_cli.engine.model.moe.layer import in_backward
from kforge_cli.engine.parallel import training_step_infers_metadata
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.moe_step import share_load_over_data_parallel
from kforge_cli.engine.train.pipeline_step import PipelineStep
from kforge_cli.engine.train.step import Batch, TokenNormaliser

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from kforge_cli.engine.train.session import TrainingSession


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the MoE output; in backward, also ``d(step loss)/d(aux) = weight`` for the aux loss."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype  # a 0-dim tensor: not saved for backward, never recomputed
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad_output, ctx.weight.to(ctx.aux_dtype), None


class AuxLossFeed:
    """Forward hooks on this rank's MoE layers that feed each micro-batch's aux-loss gradient."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.layers = [(key, layer) for module in modules for key, layer in moe_layers(module)]
        self.weights: torch.Tensor | None = None  # [micro-batches]: d(step loss)/d(aux) of each
        self.skip_first = False
        self.forwards: dict[str, int] = {}
        self.handles: list[RemovableHandle] = [
            layer.register_forward_hook(self._hook(key)) for key, layer in self.layers
        ]

    def start(self, weights: torch.Tensor, *, infers_metadata: bool) -> None:
        self.weights, self.skip_first = weights, infers_metadata
        self.forwards = {key: 0 for key, _ in self.layers}

    def finish(self) -> None:
        """Check that every layer ran one forward per micro-batch (a schedule that did not is not trained right)."""
        if self.weights is None:
            return
        want = self.weights.numel() + int(self.skip_first)
        wrong = {key: n for key, n in self.forwards.items() if n != want}
        self.weights = None
        if wrong:
            raise RuntimeError(f"MoE layers ran {wrong} training forwards in one pipeline step, expected {want} each")

    def _hook(self, key: str) -> Any:
        # Kept out of torch.compile'd blocks (a graph break): it counts forwards in Python, which
        # a traced graph would specialise on, recompiling for every micro-batch index.
        @torch.compiler.disable
        def after_forward(layer: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
            # Not gated on grad mode: torch 2.11 infers shapes under no_grad, 2.13 with grad enabled.
            if self.weights is None or not layer.training or in_backward():
                return None
            n = self.forwards[key]
            self.forwards[key] = n + 1
            assert isinstance(layer, MoEFeedForward)
            if self.skip_first and n == 0:  # the schedule's shape inference, on stand-in activations
                layer.reset_step_stats()  # zero at a step's start (finish_moe_step, load, init)
                return None
            aux = layer.aux_loss
            if aux is None:
                return None
            return _AuxLossGradient.apply(output, aux, self.weights[n - int(self.skip_first)])

        return after_forward


class MoEPipelineStep(PipelineStep):
    """Pipeline step + aux-loss gradients per micro-batch + bias update and load metrics once per step."""

    def __init__(self) -> None:
        self.feed: AuxLossFeed | None = None
        self.metrics: dict[str, torch.Tensor] = {}

    def before_schedule(self, session: TrainingSession, micro_batches: list[Batch], norm: TokenNormaliser) -> None:
        if session.pipeline is None:
            raise RuntimeError("the pipeline step needs a model built with distributed.pp > 1")
        if self.feed is None:
            self.feed = AuxLossFeed(session.pipeline.modules)
        share_load_over_data_parallel(session)
        infers = training_step_infers_metadata(session.pipeline.schedule)
        self.feed.start(norm.per_micro_batch.float() * norm.scale, infers_metadata=infers)

    def after_backward(self, session: TrainingSession) -> None:
        if self.feed is not None:
            self.feed.finish()
        local = finish_moe_step(session.model, session.runtime.dp_group())
        self.metrics = gather_over_stages(session, local)

    def extra(self) -> Mapping[str, float | torch.Tensor]:
        return dict(self.metrics)


def gather_over_stages(session: TrainingSession, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MoE metrics of every stage on every pipeline rank (one all-reduce of a small device vector)."""
    moe = session.settings.model.moe
    if moe is None:
        return local
    kinds = ["load_max_over_mean", "dropped"]
    if moe.aux_loss_weight > 0 or moe.z_loss_weight > 0:
        kinds.append("aux_loss")
    keys = [str(i) for i in range(session.settings.model.n_layers) if moe.is_moe_layer(i)]
    names = [f"moe/{key}/{kind}" for key in keys for kind in kinds]
    zero = torch.zeros((), dtype=torch.float64, device=session.runtime.device)
    values = torch.stack([local.get(name, zero).to(zero) for name in names])
    all_reduce_sum(values, session.runtime.pp_group())  # each layer lives on exactly one stage
    out = dict(zip(names, values.unbind(), strict=True))
    if keys:
        out["moe/load_max_over_mean"] = values.view(len(keys), len(kinds))[:, 0].mean()
    return out
