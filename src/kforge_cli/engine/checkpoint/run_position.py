"""`TrainState`: the loop's position (steps, tokens) that every checkpoint carries."""

from __future__ import annotations

from dataclasses import dataclass, field

from kforge_cli.common.json_values import dict_of, int_of, list_of


@dataclass
class TrainState:
    """Progress that a checkpoint must carry (JSON-serialisable)."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    # Data windows skipped by rewinds: the records engine.train.rewind writes (step numbers, read back by the loader).
    data_skips: list[dict[str, int]] = field(default_factory=list)

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {"step": self.step, "tokens_seen": self.tokens_seen}
        if self.data_skips:
            state["data_skips"] = [dict(s) for s in self.data_skips]
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step = int_of(state["step"])
        self.tokens_seen = int_of(state["tokens_seen"])
        skips = list_of(state.get("data_skips") or [], "data_skips")
        self.data_skips = [{k: int_of(v) for k, v in dict_of(s, "a data skip").items()} for s in skips]
