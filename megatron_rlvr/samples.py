"""The data that crosses rooms: a Sample is one response, a Group the n responses to one
prompt. Serialisable (plain fields, numpy for routing) so it can cross Ray and processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sample:
    prompt_id: str
    group_id: str
    index: int  # within the group
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token
    finish_reason: str  # "length" | "stop" | "abort"
    weight_version: str  # of the last generated token
    weight_versions: list[dict] = field(default_factory=list)  # [{"version", "start", "end"}, ...]
    routed_experts: np.ndarray | None = None  # [prompt+response − 1, layers, top_k], compact
    reward: float | None = None
    engine: str = ""


@dataclass
class Group:
    prompt_id: str
    group_id: str
    samples: list[Sample]
    answer: str | None = None
    error: str | None = None  # set when no engine could produce it
    aborted: bool = False
