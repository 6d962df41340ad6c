"""Facts about each pipeline schedule, in one table (validation, the parallel build and the planner read it).

Torch-free: the torch class is named, not imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

PipelineSchedule = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
]


@dataclass(frozen=True)
class ScheduleFacts:
    torch_class: str  # in torch.distributed.pipelining.schedules
    multi_stage: bool  # several stages per rank (interleaved); else exactly one
    v_shaped: bool  # exactly two stages per rank, placed in a V (rank r holds stages r and 2*pp-1-r)
    zero_bubble: bool  # splits the backward into input and weight passes
    # The oldest torch (major, minor) it trains right with: torch 2.11's zero-bubble schedules fail
    # at their first step (interleaved: the weight-gradient pass sums mismatched gradients; the V
    # schedules: their first send/receive over gloo finds the pair unconnected). Measured on CPU.
    min_torch: tuple[int, int] = (2, 11)


SCHEDULES: dict[str, ScheduleFacts] = {
    "gpipe": ScheduleFacts("ScheduleGPipe", multi_stage=False, v_shaped=False, zero_bubble=False),
    "1f1b": ScheduleFacts("Schedule1F1B", multi_stage=False, v_shaped=False, zero_bubble=False),
    "interleaved_1f1b": ScheduleFacts("ScheduleInterleaved1F1B", multi_stage=True, v_shaped=False, zero_bubble=False),
    "interleaved_zero_bubble": ScheduleFacts(
        "ScheduleInterleavedZeroBubble", multi_stage=True, v_shaped=False, zero_bubble=True, min_torch=(2, 13)
    ),
    "zbv_zero_bubble": ScheduleFacts(
        "ScheduleZBVZeroBubble", multi_stage=True, v_shaped=True, zero_bubble=True, min_torch=(2, 13)
    ),
    "dualpipev": ScheduleFacts(
        "ScheduleDualPipeV", multi_stage=True, v_shaped=True, zero_bubble=True, min_torch=(2, 13)
    ),
}
assert set(SCHEDULES) == set(get_args(PipelineSchedule)), "every schedule name has its facts"


def schedule_facts(name: str) -> ScheduleFacts:
    return SCHEDULES[name]
