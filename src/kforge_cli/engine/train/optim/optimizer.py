"""Build the optimizer of a job (AdamW, Lion or Muon) with weight-decay groups chosen by parameter name.

Why groups: weight decay pulls weights towards zero. That regularises matrices, but
on a norm's gain or a bias it only fights the signal, and on an embedding row it
shrinks rare tokens that get few gradient updates; so by default neither is decayed
(``optimizer.decay_norms_and_biases`` / ``optimizer.decay_embeddings`` turn it on).

Every parameter is placed in a group, frozen ones included: a later unfreeze must
train them, and the optimizer simply skips a parameter whose ``.grad`` is None. Each
group carries a ``"name"`` (``decay``, ``no_decay``, ``muon``) for logging. The
optimizer state has the dtype of the parameters, i.e. of ``train.master_dtype``.
"""

from __future__ import annotations

import torch
from torch import nn

from kforge_cli.engine.model.module_names import clean_param_name
from kforge_cli.engine.runtime.dtypes import DTYPES
from kforge_cli.engine.train.optim.lion import Lion
from kforge_cli.engine.train.optim.muon import Muon, ParamGroup
from kforge_cli.errors import ConfigError, ConfigIssue
from kforge_cli.settings.training import OptimizerSettings

HEAD_PARAM_NAME = "output.weight"
EMBEDDING_NAME_MARKER = "embeddings"


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every (cleaned) name of every parameter, keyed by identity (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(clean_param_name(name))
    return names


def _embedding_ids(model: nn.Module, aliases: dict[int, list[str]]) -> set[int]:
    """Parameters that are embeddings: ``nn.Embedding`` weights or named ``*embeddings*`` (a tied head too)."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    ids |= {pid for pid, names in aliases.items() if any(EMBEDDING_NAME_MARKER in n for n in names)}
    return ids


def _is_head(names: list[str]) -> bool:
    return any(n == HEAD_PARAM_NAME or n.endswith("." + HEAD_PARAM_NAME) for n in names)


def build_param_groups(model: nn.Module, cfg: OptimizerSettings, *, muon: bool = False) -> list[ParamGroup]:
    """Param groups for ``model``: ``decay`` / ``no_decay`` (and ``muon`` when ``muon`` is True).

    ``no_decay`` holds 1-D (and 0-D) parameters unless ``decay_norms_and_biases``, and
    embeddings unless ``decay_embeddings``. With ``muon``, the 2-D weights that are
    neither embeddings nor the output head (``output.weight``) form the ``muon`` group
    (``lr = optimizer.muon_lr``, decayed); the rest keep AdamW (``lr = optimizer.lr``).
    Empty groups are left out; the order is deterministic (model order within a group).
    """
    opt = cfg
    aliases = _aliases(model)
    embeddings = _embedding_ids(model, aliases)
    buckets: dict[str, list[nn.Parameter]] = {"muon": [], "decay": [], "no_decay": []}
    for param in model.parameters():  # deduplicated: a tied weight appears once
        names = aliases[id(param)]
        is_embedding = id(param) in embeddings
        if muon and param.ndim == 2 and not is_embedding and not _is_head(names):
            buckets["muon"].append(param)
        elif (param.ndim < 2 and not opt.decay_norms_and_biases) or (is_embedding and not opt.decay_embeddings):
            buckets["no_decay"].append(param)
        else:
            buckets["decay"].append(param)
    groups: list[ParamGroup] = []
    if buckets["muon"]:
        groups.append(
            {
                "name": "muon",
                "params": buckets["muon"],
                "use_muon": True,
                "lr": opt.muon_lr,
                "weight_decay": opt.weight_decay,
            }
        )
    for name, wd in (("decay", opt.weight_decay), ("no_decay", 0.0)):
        if buckets[name]:
            group: ParamGroup = {"name": name, "params": buckets[name], "lr": opt.lr, "weight_decay": wd}
            if muon:
                group["use_muon"] = False
            groups.append(group)
    return groups


def _all_params(groups: list[ParamGroup]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


def use_fused_adamw(params: list[torch.Tensor], fused: bool | None) -> bool:
    """``optimizer.fused`` if set, else True when every parameter (plain or DTensor) is a CUDA float tensor."""
    if fused is not None:
        return fused
    return bool(params) and all(p.device.type == "cuda" and p.dtype in DTYPES.values() for p in params)


def _build_adamw(groups: list[ParamGroup], opt: OptimizerSettings) -> torch.optim.AdamW:
    fused = use_fused_adamw(_all_params(groups), opt.fused)
    try:
        return torch.optim.AdamW(
            groups,
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
        )
    except RuntimeError as exc:
        if not fused:
            raise
        issue = ConfigIssue(
            "optimizer.fused", f"the fused AdamW kernel cannot take these parameters ({exc}); set it to false"
        )
        raise ConfigError([issue]) from exc


def build_optimizer(model: nn.Module, opt: OptimizerSettings) -> torch.optim.Optimizer:
    """The optimizer named by ``opt.name`` (the ``optimizer`` section) over ALL parameters of ``model``
    (see the module docstring)."""
    if opt.name == "adamw":
        return _build_adamw(build_param_groups(model, opt), opt)
    if opt.name == "lion":
        return Lion(build_param_groups(model, opt), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
    if opt.name == "muon":
        return Muon(
            build_param_groups(model, opt, muon=True),
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            momentum=opt.muon_momentum,
            nesterov=opt.muon_nesterov,
            ns_steps=opt.muon_ns_steps,
            betas=opt.betas,
            distributed=opt.muon_distributed,
            eps=opt.eps,
        )
    raise ConfigError([ConfigIssue("optimizer.name", f"unknown optimizer {opt.name!r}; use adamw, lion or muon")])
