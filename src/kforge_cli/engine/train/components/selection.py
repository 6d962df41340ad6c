"""`components_for(settings)`: the loop components a configuration needs, in the order the loop calls them.

Beside `engine.train.features.features_for` (what acts inside the step), this lists what acts
around it. The recipe puts the user's hooks (``train.hooks``, ``run_training(hooks=...)``)
first: they see each step's numbers before a spike decision may rewind it and before that
step's evaluation.
"""

from __future__ import annotations

from kforge_cli.engine.train.components import LoopComponent
from kforge_cli.engine.train.components.early_stop import EarlyStop
from kforge_cli.engine.train.components.eval_after_checkpoint import EvalAfterCheckpoint
from kforge_cli.engine.train.components.hang_watch import HangWatch
from kforge_cli.engine.train.components.in_loop_eval import InLoopEval
from kforge_cli.engine.train.components.loss_spike import LossSpike
from kforge_cli.engine.train.components.nan_policy import NanPolicy
from kforge_cli.engine.train.components.profiling import Profiling
from kforge_cli.engine.train.components.reporting import ProgressLine, Throughput
from kforge_cli.engine.train.components.stop_vote import StopOnSignal
from kforge_cli.engine.train.components.straggler_watch import StragglerReport
from kforge_cli.settings import JobSettings


def components_for(settings: JobSettings, world_size: int = 1) -> list[LoopComponent]:
    """The components of this configuration, in the order the loop calls them (fresh objects:
    components keep state)."""
    r = settings.resilience
    components: list[LoopComponent] = []
    if r.hang_timeout_s != 0:
        components.append(HangWatch())
    components += [StopOnSignal(), NanPolicy(r), Throughput()]
    if r.straggler_ratio != 0 and world_size > 1:
        components.append(StragglerReport())
    if settings.profiling.enabled or settings.train.device != "cpu":  # CUDA: memory snapshots at an OOM
        components.append(Profiling())
    if r.spike_policy != "off":
        components.append(LossSpike(r))
    if settings.eval.interval:
        components.append(InLoopEval(settings.eval.interval))
    if settings.eval.after_checkpoint:
        components.append(EvalAfterCheckpoint())
    if settings.train.early_stop_patience:
        components.append(EarlyStop(settings.train.early_stop_patience, settings.train.early_stop_min_delta))
    return [*components, ProgressLine()]  # last: it shows what the others added to a record
