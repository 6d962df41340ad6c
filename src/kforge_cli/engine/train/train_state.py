"""`TrainState`: the loop's position (steps, tokens) that every checkpoint carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TrainState:
    """Progress that a checkpoint must carry (JSON-serialisable)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
