"""The data that crosses rooms: a Sample is one response, a Group the n responses to one
prompt. Serialisable (plain fields, numpy for routing) so it can cross Ray and processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class EpisodeStats:
    """How an episode (agent/) went: model turns, tool calls (and how many were errors), the
    seconds its tools ran, prefix breaks, why it ended (answer | max_turns | length | budget |
    prefix_break | abort), each tool's reward, and the final model turn's text."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    prefix_breaks: int = 0
    ended: str = ""
    tool_rewards: list[float] = field(default_factory=list)
    final_text: str = ""


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
    # an episode (agent/): 1 on tokens the model sampled, 0 on tool turns and template
    # boundaries (never scored or trained); None: every response token was sampled
    loss_mask: list[int] | None = None
    episode: EpisodeStats | None = None  # an episode's turns and tools (None: one answer)

    def sampled_mask(self) -> list[int]:
        """1 per response token the model sampled (all of them unless loss_mask says otherwise)."""
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    def sampled_tokens(self) -> int:
        """The response's length as the model generated it (an episode's tool turns excluded)."""
        return sum(self.sampled_mask())

    def token_versions(self) -> list[int]:
        """The policy version that computed each response token, from the engine's spans (a
        reply without spans: every token the version of the last one)."""
        versions = [int(self.weight_version)] * len(self.response_ids)
        for span in self.weight_versions:
            start, end = span["start"], min(span["end"], len(versions))
            versions[start:end] = [int(span["version"])] * max(end - start, 0)
        return versions


@dataclass
class Group:
    prompt_id: str
    group_id: str
    samples: list[Sample]
    answer: str | None = None
    error: str | None = None  # set when no engine could produce it
    aborted: bool = False
