"""The `agent:` section: rollouts as multi-turn episodes with tool calls (megatron_rlvr/agent/).
No section: every rollout is one answer, as before."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rlvr.config.base import PositiveInt, Section
from megatron_rlvr.config.base import raise_problems as _raise


class AgentConfig(Section):
    """Episodes: the model's turn, its tool calls run, their results appended as the chat
    template's tool turn, the next model turn, until an answer, max_turns or the token budget
    (rollout.max_new_tokens over the whole response, tool turns included)."""

    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="tools the model may call: shipped names (calculator, python) or 'path.to.module:function' "
        "(a function, or a Tool subclass); per-record arguments come from extra_info.tools_kwargs.<name>",
    )
    max_turns: PositiveInt = Field(8, description="model turns per episode (verl: max_assistant_turns)")
    max_tool_calls_per_turn: PositiveInt = Field(
        4, description="calls run per model turn; those over it are errors the model sees (verl: max_parallel_calls)"
    )
    tool_timeout_s: float = Field(30.0, gt=0, description="deadline of one tool call; past it the model sees an error")
    max_tool_response_length: PositiveInt = Field(
        4096, description="characters of a tool's output shown to the model; longer is cut in the middle, marked"
    )
    tool_workers: PositiveInt = Field(8, description="tool calls running at once (threads) in the rollout process")
    python_memory_mb: PositiveInt = Field(512, description="address-space limit of the python tool's sandboxed child")
    reward_aggregator: Literal["last", "sum"] = Field(
        "last",
        description="last: the verifier's reward of the final answer; sum: that plus every tool-granted reward",
    )
    tool_call_format: Literal["hermes", "glm45", "deepseekv3"] | None = Field(
        None,
        description="how tool calls are written; None: the model family's own (qwen: hermes, glm4_moe: glm45, "
        "deepseek_v3: deepseekv3)",
    )
    max_episode_attempts: PositiveInt = Field(
        2, description="tries of an episode whose tool machinery failed before its group fails (counted)"
    )

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        problems = []
        if not self.tools:
            problems.append("agent.tools is empty: name at least one tool (e.g. calculator)")
        if len(set(self.tools)) != len(self.tools):
            problems.append(f"agent.tools = {self.tools}: a tool is named twice")
        _raise(problems)
        return self
