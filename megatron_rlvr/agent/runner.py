"""The run's agent: its tools, parser, renderer and limits, built once from the `agent:` section,
making one Episode per sample. The rollout manager holds it (None: single-turn rollouts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_rlvr.agent.episode import DecodeRouting, Episode, EpisodeSettings, Generate
from megatron_rlvr.agent.parsers import parser_for
from megatron_rlvr.agent.render import TurnRenderer, check_template
from megatron_rlvr.agent.tools import PythonTool, ToolPool, load_tools
from megatron_rlvr.samples import Sample

if TYPE_CHECKING:
    from megatron_rlvr.config.agent import AgentConfig


class AgentRunner:
    def __init__(
        self,
        cfg: AgentConfig,
        tokenizer,
        *,
        model_type: str | None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        """Refuses (one line each) a tool that cannot be loaded, a family without a tool-call
        format, and a chat template that rewrites past turns."""
        self.cfg, self.tokenizer = cfg, tokenizer
        tools = load_tools(cfg.tools)
        for tool in tools.values():
            if isinstance(tool, PythonTool):
                tool.timeout_s, tool.memory_mb = cfg.tool_timeout_s, cfg.python_memory_mb
        self.pool = ToolPool(
            tools, workers=cfg.tool_workers, timeout_s=cfg.tool_timeout_s, max_chars=cfg.max_tool_response_length
        )
        self.parser = parser_for(cfg.tool_call_format, model_type)
        self.renderer = TurnRenderer(
            tokenizer, chat_template=chat_template, template_kwargs=template_kwargs, tools=self.pool.schemas()
        )
        check_template(self.renderer)
        self.max_episode_attempts = cfg.max_episode_attempts  # tries before a group fails (the manager)
        self.settings = EpisodeSettings(max_turns=cfg.max_turns, max_tool_calls_per_turn=cfg.max_tool_calls_per_turn)

    def episode(
        self,
        generate: Generate,
        decode_routing: DecodeRouting | None = None,
        aborted: Callable[[], bool] = lambda: False,
    ) -> Episode:
        return Episode(
            renderer=self.renderer,
            parser=self.parser,
            pool=self.pool,
            settings=self.settings,
            tokenizer=self.tokenizer,
            generate=generate,
            decode_routing=decode_routing,
            aborted=aborted,
        )

    def reward(self, verdict: float, sample: Sample) -> float:
        """The episode's reward from the final answer's verdict and its tools' rewards."""
        if self.cfg.reward_aggregator == "sum" and sample.episode is not None:
            return verdict + sum(sample.episode.tool_rewards)
        return verdict
