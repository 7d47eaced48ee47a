"""Which training prompts a run draws, beyond the files themselves: mixing weights per domain
(a record's domain is the verifier that scores it: math, code, ifeval, or a function's name)
and the prompts a difficulty file says carry no signal (written by `megatron-rlvr profile`).
A mixin of the training data sections (data.*); megatron_rlvr.rollout.domains applies it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rlvr.config.base import Section
from megatron_rlvr.config.base import raise_problems as _raise


class PromptSelection(Section):
    """Mixing weights per domain and the difficulty skip of the training data."""

    mixing: dict[str, float] = Field(
        default_factory=dict,
        description="domain (the record's verifier: math, code, ifeval, a function's name) → its share of the "
        "prompts drawn, e.g. {math: 2, ifeval: 1}; every domain of the data needs a weight; empty: the data as it is",
    )
    difficulty_file: str | None = Field(
        None,
        description="a prompt-difficulty file written by `megatron-rlvr profile` (JSONL: id, domain, n, pass_rate, "
        "outcome); the prompts it lists with an outcome in difficulty_skip are never drawn; None: none skipped",
    )
    difficulty_skip: Literal["all_wrong", "all_right", "both"] = Field(
        "both",
        description="which prompts of difficulty_file to skip: those whose profiled group was all wrong, all "
        "right, or both (neither carries a gradient)",
    )

    @model_validator(mode="after")
    def _check_selection(self) -> PromptSelection:
        bad = {domain: w for domain, w in self.mixing.items() if not w > 0}
        if bad:
            _raise([f"data.mixing = {self.mixing}: every weight must be > 0 (drop a domain by filtering its rows)"])
        return self
