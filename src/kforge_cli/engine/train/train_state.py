"""`TrainState`: the loop's position (steps, tokens) that every checkpoint carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Progress that a checkpoint must carry (JSON-serialisable)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    # Data windows skipped by loss-spike rewinds: {"spike_step", "detected_at", "rewound_to", "skipped_steps"}.
    data_skips: list[dict[str, int]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "tokens_seen": self.tokens_seen}
        if self.data_skips:
            state["data_skips"] = [dict(s) for s in self.data_skips]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.data_skips = [{k: int(v) for k, v in s.items()} for s in state.get("data_skips") or []]
