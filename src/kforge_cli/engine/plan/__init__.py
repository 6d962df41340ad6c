"""The planner (layer 4, beside ``checkpoint/``): memory plan, cost model and layout search.

It sums the memory and communication terms that each parallelism (``parallel/``) and each
model family (``families/``) exports; it sits below ``train/`` so a job can re-plan at start.
Rank R's real sharded model on meta under a fake process group (`sharded_model`), activation
estimates per AC mode (`activations`), communication buffers, optimizer state and step-time
costs (`costs`), the plan itself (`planner`) and its table/JSON rendering (`report`)."""

from kforge_cli.engine.plan.planner import GIB, ParallelPlan, build_plan
from kforge_cli.engine.plan.report import format_plan, plan_json

__all__ = ["GIB", "ParallelPlan", "build_plan", "format_plan", "plan_json"]
