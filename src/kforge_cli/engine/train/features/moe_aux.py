"""MoE as a step feature: the routers' aux losses in the backward, balancing once per step.

Aux losses: each MoE layer keeps the weighted load-balance and z-loss of its latest
forward, a mean over this rank's tokens of the micro-batch. Its gradient is that of the
term weighted by the micro-batch's valid tokens (`TokenNormaliser.term_counts`), so after
the step's division by the global token count (and the gradient average over data-parallel
ranks) it is the token-weighted mean over all micro-batches and ranks; the load-balance
loss's expert shares are those of the whole global micro-batch (all-reduced in the forward
over dp x cp, every rank whose tokens differ), so data and context parallelism train exactly
like one process on the same global batch. The reported ``loss`` stays the language-model
loss; the aux values are logged separately (``moe/<layer>/aux_loss``).

How the term reaches the gradient depends on the executor:

- accumulating: `loss_term` returns the model's summed aux loss after each micro-batch's
  forward, and the executor adds it (weighted) to that micro-batch's loss sum;
- pipeline schedule: the loss exists on the last stage only and each stage runs each
  micro-batch's forward and backward separately, so `AuxLossFeed` puts a forward hook on
  every MoE layer of this rank's stages that wraps the layer's output in
  `_AuxLossGradient`: the output passes through unchanged, and its backward also gives the
  layer's aux loss its weight for that micro-batch. Every torch schedule runs a stage's
  forwards in micro-batch order, so the hook counts a layer's forwards within the step. It
  counts only training forwards outside the autograd engine (the recompute of activation
  checkpointing runs inside it and is neither counted nor wrapped again). At the first step,
  and after each evaluation, the schedule first runs one forward per stage on stand-in
  activations to infer shapes (`training_step_infers_metadata`; under no_grad in torch 2.11,
  with grad in 2.13); the hook leaves that
  forward unwrapped and clears the token counts it made.

Balancing: after the last backward, `finish_moe_step` all-reduces the step's expert counts
over dp x cp (tensor-parallel peers route the same tokens and are not summed), updates the
selection biases identically everywhere and returns the per-layer load metrics. Under a
pipeline these exist only on the stage that holds the layer: they are summed over the
pipeline group into one vector with a slot per MoE layer, on the device (no host read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kforge_cli.engine.model.moe import MoEFeedForward, finish_moe_step, moe_aux_loss, moe_layers
from kforge_cli.engine.model.moe.layer import in_backward
from kforge_cli.engine.parallel import training_step_infers_metadata
from kforge_cli.engine.runtime import all_reduce_sum
from kforge_cli.engine.train.step.core import Batch, StepFeature

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

    def _hook(self, key: str) -> Any:  # torch.compiler.disable's wrapper has no usable static type
        # Kept out of torch.compile'd blocks (a graph break): it counts forwards in Python, which
        # a traced graph would specialise on, recompiling for every micro-batch index.
        @torch.compiler.disable
        def after_forward(layer: nn.Module, inputs: tuple[object, ...], output: torch.Tensor) -> torch.Tensor | None:
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


def share_load_over_ranks(session: TrainingSession) -> None:
    """Let every MoE layer's load-balance loss use the expert load of all ranks whose tokens differ."""
    distributed = session.runtime.loss_ranks > 1
    for _, layer in moe_layers(session.model):
        layer.load_group, layer.global_load = session.runtime.loss_group(), distributed


class MoEFeature(StepFeature):
    """Aux losses in the backward (per executor, see the module docstring), bias update and load metrics."""

    def __init__(self) -> None:
        self.feed: AuxLossFeed | None = None
        self.metrics_: dict[str, torch.Tensor] = {}

    def before_step(self, session: TrainingSession, micro_batches: Sequence[Batch]) -> None:
        share_load_over_ranks(session)

    def loss_term(self, session: TrainingSession, batch: Batch) -> torch.Tensor | None:
        return moe_aux_loss(session.model)

    def before_schedule(self, session: TrainingSession, weights: torch.Tensor) -> None:
        if session.pipeline is None:
            raise RuntimeError("the schedule executor needs a model built with distributed.pp > 1")
        if self.feed is None:
            self.feed = AuxLossFeed(session.pipeline.modules)
        infers = training_step_infers_metadata(session.pipeline.schedule)
        self.feed.start(weights, infers_metadata=infers)

    def after_backward(self, session: TrainingSession) -> None:
        if self.feed is not None:
            self.feed.finish()
        local = finish_moe_step(session.model, session.runtime.loss_group())
        self.metrics_ = gather_over_stages(session, local) if session.pipeline is not None else local

    def metrics(self) -> Mapping[str, float | torch.Tensor]:
        return dict(self.metrics_)


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
