"""engine.train.optim: the optimizers kforge builds (AdamW, Muon, Lion), their parameter groups and
the learning-rate schedule."""

from kforge_cli.engine.train.optim.optimizer import build_optimizer, build_param_groups
from kforge_cli.engine.train.optim.scheduler import build_scheduler

__all__ = ["build_optimizer", "build_param_groups", "build_scheduler"]
