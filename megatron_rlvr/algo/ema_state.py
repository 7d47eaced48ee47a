"""The state of the exponential-moving-average baseline, without torch: the run keeps it and
checkpoints it beside the sampler's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EmaBaselines:
    """Per-prompt exponential moving averages of group mean rewards."""

    values: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {"values": dict(self.values)}

    @classmethod
    def from_dict(cls, state: dict[str, dict[str, float]]) -> EmaBaselines:
        return cls(values={str(k): float(v) for k, v in state["values"].items()})
