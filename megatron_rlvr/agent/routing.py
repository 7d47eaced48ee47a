"""Routing replay (R3) across an episode's turns.

Each turn of an episode is one /generate request whose input is the previous turn's input and
output followed by the tool turn, and the engine returns the routing of every position of that
request but its last token. What it holds for the history positions depends on the prefix
cache (measured with SGLang 0.5.23: docs/routing-replay.md#across-turns): on a cache hit the
earlier turn's rows, read back from the KV slots that turn computed; on a miss (a flush, e.g.
the one that ends every weight sync) the history computed again under the weights of this
turn's prefill. Either way the last turn's rows are the routing of the KV that the last turn's
tokens were computed from, which is the one routing a single learner forward can replay:

    the episode's routing is the last turn's, for every position.

Earlier turns' tokens sampled before a weight sync keep their own version and behaviour
logprob (the rollout correction weighs them as any stale token). Prefix KV never crosses
versions: the syncer flushes the cache at every sync, and the config refuses an in-place pause
with SGLang's radix cache on (it cannot be flushed then) and SGLang's HiCache storage tier
(the flush leaves it).
"""

from __future__ import annotations

import numpy as np

from megatron_rlvr.rollout.routed_experts import RoutedExpertsError


def episode_routing(last_turn: np.ndarray, fed: int, sample: str) -> np.ndarray:
    """The episode's routing: the last turn's rows [fed − 1, layers, top_k], where fed is the
    episode's prompt and response (the last turn's input and output). Rows that do not cover
    exactly those positions (an engine that returned a turn's routing short, or an episode that
    grew after its last turn) are a RoutedExpertsError naming the sample."""
    if last_turn.shape[0] != fed - 1:
        raise RoutedExpertsError(
            f"sample {sample}: the last turn's routed_experts has {last_turn.shape[0]} rows, the episode "
            f"fed {fed - 1} positions (its {fed} tokens but the last)"
        )
    return last_turn
