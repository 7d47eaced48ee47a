"""One episode: generate → parse tool calls → run them → render the tool turn → generate …,
until a turn with no tool call (the answer), agent.max_turns model turns, or the token budget.

Each turn is one engine request with the ids so far (`input_ids`, n = 1: a group's samples
are n episodes run concurrently), return_logprob, and return_routed_experts when routing is
replayed. The episode accumulates ONE Sample: response_ids = everything after the prompt
(model turns as sampled, boundary and tool tokens as rendered: render.py), loss_mask 1 exactly
on sampled tokens, rollout_logprobs one per response token (0.0 where the mask is 0),
weight_versions spans over the model's tokens, finish_reason the last turn's (a turn cut at
its token limit ends the episode as `length`), and routed_experts from the last turn's reply,
which covers every position of the sequence but the last.

The token budget is the rollout's max_new_tokens over the whole response (model and tool
tokens alike, as the context grows by both): a turn may sample at most what is left, and a
tool turn that would not fit ends the episode as `length`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_rlvr.agent.parsers import Parser
from megatron_rlvr.agent.render import TurnRenderer
from megatron_rlvr.agent.routing import episode_routing
from megatron_rlvr.agent.tools import ToolPool, ToolResult
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.samples import EpisodeStats, Sample

Generate = Callable[[p.GenerateReqInput], Awaitable[p.GenerateResponse]]
DecodeRouting = Callable[[p.MetaInfo, str], "np.ndarray | None"]


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int = 8
    max_tool_calls_per_turn: int = 4


@dataclass
class Turn:
    """What the test and the metrics see of one turn: its input and what the model sampled."""

    input_ids: list[int]
    output_ids: list[int]
    finish_reason: str


class Episode:
    """Runs one episode of a prompt; `turns` records each turn's input and output."""

    def __init__(
        self,
        *,
        renderer: TurnRenderer,
        parser: Parser,
        pool: ToolPool,
        settings: EpisodeSettings,
        tokenizer,
        generate: Generate,
        decode_routing: DecodeRouting | None = None,
        aborted: Callable[[], bool] = lambda: False,
    ):
        """aborted(): asked before each turn after the first; True ends the episode as aborted
        (the rollout was aborted while its tools ran)."""
        self.renderer, self.parser, self.pool, self.settings = renderer, parser, pool, settings
        self.tokenizer, self.generate, self.decode_routing = tokenizer, generate, decode_routing
        self.aborted = aborted
        self.schemas = {tool.name: tool.schema() for tool in pool.tools.values()}
        self.turns: list[Turn] = []

    async def run(
        self,
        messages: list[dict],
        sampling: p.SamplingParams,
        *,
        extra: dict[str, Any] | None = None,
        rid: str = "",
        prompt_id: str = "",
        group_id: str = "",
        index: int = 0,
    ) -> Sample:
        prompt = self.renderer.prompt(messages)
        history = list(messages)
        ids = list(prompt)
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        spans: list[dict] = []
        stats = EpisodeStats()
        budget = sampling.max_new_tokens
        last: p.GenerateResponse | None = None
        while True:
            request = p.GenerateReqInput(
                input_ids=list(ids),
                rid=f"{rid}-t{stats.turns}" if rid else None,
                return_logprob=True,
                sampling_params=sampling.model_copy(
                    update={
                        "n": 1,
                        "max_new_tokens": budget - len(response),
                        "sampling_seed": _turn_seed(sampling.sampling_seed, index, stats.turns),
                    }
                ),
                return_routed_experts=self.decode_routing is not None,
            )
            last = await self.generate(request)
            out, meta = last.output_ids, last.meta_info
            self.turns.append(Turn(list(ids), list(out), meta.finish_reason.type))
            stats.turns += 1
            start = len(response)
            response += out
            mask += [1] * len(out)
            logprobs += [float(row[0]) for row in meta.output_token_logprobs or []][: len(out)]
            logprobs += [0.0] * (len(response) - len(logprobs))
            spans += _shifted_spans(meta, start, len(out))
            ids += out
            text = self.tokenizer.decode(_strip_end(out, self.renderer.end_ids), skip_special_tokens=False)
            stats.final_text = text
            if meta.finish_reason.type != "stop":  # length (the turn was cut) or abort
                stats.ended = meta.finish_reason.type
                break
            parsed = self.parser(text, self.schemas)
            if not parsed.calls:
                stats.ended = "answer"
                break
            if stats.turns >= self.settings.max_turns:
                stats.ended = "max_turns"
                break
            results = await self._run_calls(parsed.calls, extra, stats)
            tool_messages = [{"role": "tool", "name": name, "content": r.text} for name, r in results]
            bridge = self.renderer.bridge(history, text, tool_messages, out)
            if bridge.broken:
                stats.prefix_breaks += 1
                stats.ended = "prefix_break"
                break
            if len(response) + len(bridge.ids) >= budget:
                stats.ended = "length"
                break
            if self.aborted():
                stats.ended = "abort"
                break
            history += [{"role": "assistant", "content": text}, *tool_messages]
            response += bridge.ids
            mask += [0] * len(bridge.ids)
            logprobs += [0.0] * len(bridge.ids)
            ids += bridge.ids
        assert last is not None
        finish = stats.ended if stats.ended in ("length", "abort") else last.meta_info.finish_reason.type
        routed = None
        if self.decode_routing is not None and finish != "abort":  # an aborted episode is never trained
            routed = self.decode_routing(last.meta_info, f"{group_id}/{index}")
            if routed is not None:  # R3 across turns: agent/routing.py
                routed = episode_routing(routed, len(prompt) + len(response), f"{group_id}/{index}")
        return Sample(
            prompt_id=prompt_id,
            group_id=group_id,
            index=index,
            prompt_ids=prompt,
            response_ids=response,
            rollout_logprobs=logprobs,
            finish_reason=finish,
            weight_version=last.meta_info.weight_version,
            weight_versions=spans,
            routed_experts=routed,
            loss_mask=mask,
            episode=stats,
        )

    async def _run_calls(
        self, calls, extra: dict[str, Any] | None, stats: EpisodeStats
    ) -> list[tuple[str, ToolResult]]:
        """Runs a turn's calls concurrently (at most max_tool_calls_per_turn; those over it, and
        calls that could not be parsed, are errors the model sees)."""
        limit = self.settings.max_tool_calls_per_turn

        async def one(position: int, call) -> tuple[str, ToolResult]:
            if call.error is not None:
                return call.name or "error", ToolResult(f"error: {call.error}", error=True)
            if position >= limit:
                return call.name, ToolResult(f"error: at most {limit} tool calls per turn", error=True)
            result, seconds = await self.pool.run(call.name, call.arguments, extra)
            stats.tool_s += seconds
            return call.name, result

        results = await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
        stats.tool_calls += len(calls)
        stats.tool_errors += sum(r.error for _, r in results)
        stats.tool_rewards += [r.reward for _, r in results if r.reward is not None]
        return list(results)


def _strip_end(ids: list[int], end_ids: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in end_ids else ids


def _shifted_spans(meta: p.MetaInfo, start: int, length: int) -> list[dict]:
    """A turn's weight-version spans, moved to the turn's place in the episode's response."""
    if not meta.weight_versions:
        return [{"version": meta.weight_version, "start": start, "end": start + length}] if length else []
    return [{**s, "start": s["start"] + start, "end": min(s["end"], length) + start} for s in meta.weight_versions]


def _turn_seed(seed: int | None, index: int, turn: int) -> int | None:
    """Each episode and turn its own sampling seed, derived from the group's."""
    if seed is None:
        return None
    return (seed * 1_000_003 + index * 7_919 + turn * 104_729 + 1) % 2**62
