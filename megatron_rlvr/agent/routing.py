"""Routing replay (R3) and policy versions across an episode's turns.

Each turn of an episode is one /generate request whose input is the previous turn's input and
output followed by the tool turn, and the engine returns the routing of every position of that
request but its last token. What it holds for the history positions depends on the prefix
cache (measured with SGLang 0.5.23, docs/routing-replay.md#across-turns): on a cache hit the
earlier turn's rows, read back from the KV slots that turn computed; on a miss (a flush, e.g.
the one that ends every weight sync) the history computed again under the weights of this
turn's prefill. Either way the last turn's rows are the routing of the KV that the last turn's
tokens were computed from, which is the one routing a single learner forward can replay:

    the episode's routing is the last turn's, for every position.

Earlier turns' tokens sampled before a weight sync keep their own version and behaviour
logprob (the rollout correction weighs them as any stale token); the share of their positions
the last turn routed differently is reported, so a history computed again is visible. Prefix
KV is never reused across versions: the syncer flushes the cache at every sync, and the config
refuses an in-place pause with SGLang's radix cache on (which cannot be flushed then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_rlvr.rollout.routed_experts import RoutedExpertsError


@dataclass(frozen=True)
class TurnReply:
    """What one turn's /generate returned, as far as routing and versions go."""

    input_len: int  # tokens fed: the episode's prompt, the earlier turns, the tool turns
    output_len: int  # tokens the model sampled in this turn
    routed_experts: np.ndarray  # [input_len + output_len − 1, layers, top_k], decoded
    weight_version: str  # of the turn's last token
    weight_versions: list[dict] = field(default_factory=list)  # spans over this turn's output


def episode_routing(turns: list[TurnReply], sample: str) -> tuple[np.ndarray, float]:
    """The episode's routing (the last turn's rows) and the share of the earlier turns' rows
    that the last turn routed differently (0.0: no position was routed again; > 0: history was
    computed again under other weights). Raises RoutedExpertsError, naming the sample and the
    turn, when a turn's rows do not cover its positions or turns do not follow each other."""
    if not turns:
        raise RoutedExpertsError(f"sample {sample}: an episode with no turns has no routing")
    fed = 0
    for number, turn in enumerate(turns, 1):
        positions = turn.input_len + turn.output_len - 1
        if turn.routed_experts.shape[0] != positions:
            raise RoutedExpertsError(
                f"sample {sample} turn {number}: routed_experts has {turn.routed_experts.shape[0]} rows, "
                f"the turn fed {positions} positions (input {turn.input_len} + output {turn.output_len} − 1)"
            )
        if turn.input_len < fed:
            raise RoutedExpertsError(
                f"sample {sample} turn {number}: its input ({turn.input_len} tokens) is shorter than the "
                f"turns before it ({fed}): not a continuation of them"
            )
        fed = turn.input_len + turn.output_len
    last = turns[-1].routed_experts
    earlier = [(t.routed_experts, t.input_len + t.output_len - 1) for t in turns[:-1]]
    checked = sum(n for _, n in earlier)
    moved = sum(int((rows != last[:n]).any(axis=(1, 2)).sum()) for rows, n in earlier)
    return last, (moved / checked if checked else 0.0)


def episode_weight_versions(turns: list[TurnReply], prompt_len: int) -> list[dict]:
    """Every turn's version spans as spans over the episode's response (the tokens after the
    first prompt), in SGLang's layout ({"version", "start", "end"}); tool turns fall between
    spans. A turn without spans is one span of its last token's version."""
    spans = []
    for turn in turns:
        offset = turn.input_len - prompt_len
        own = turn.weight_versions or [{"version": turn.weight_version, "start": 0, "end": turn.output_len}]
        spans += [{**s, "start": s["start"] + offset, "end": s["end"] + offset} for s in own]
    return spans
