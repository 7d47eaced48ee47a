"""What a prompt is once loaded, and the error a user gets for data that cannot be used."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.errors import UserError

ROLES = ("system", "user", "assistant", "tool")


class DataError(UserError):
    """A data file that is missing, empty or unreadable, or a bad row (file:line and why)."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as stored: `prompt` is its text or its chat messages ({role, content}),
    `answer` the ground truth its verifier checks (a string for math, tests for code)."""

    prompt_id: str
    prompt: str | list[dict[str, Any]]
    answer: Any = None
    verifier: str = "math"
    data_source: str = ""
    extra: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as a custom verifier receives it (plain JSON types)."""
        return {
            "id": self.prompt_id,
            "prompt": self.prompt,
            "ground_truth": self.answer,
            "verifier": self.verifier,
            "data_source": self.data_source,
            "extra_info": self.extra,
        }


@dataclass
class LoadedPrompts:
    records: list[PromptRecord]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file:line, why) of each bad row skipped
    by_file: dict[str, list[str]] = field(default_factory=dict)  # file label → its prompt ids (file sources)
