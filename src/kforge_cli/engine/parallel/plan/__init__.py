"""The memory/throughput planner behind `validate-config --plan`: rank R's real sharded model on
meta under a fake process group (`sharded_model`), activation estimates per AC mode
(`activations`), communication buffers, optimizer state and step-time costs (`costs`), the
plan itself (`planner`) and its table/JSON rendering (`report`)."""

from kforge_cli.engine.parallel.plan.planner import GIB, ParallelPlan, build_plan
from kforge_cli.engine.parallel.plan.report import format_plan, plan_json

__all__ = ["GIB", "ParallelPlan", "build_plan", "format_plan", "plan_json"]
