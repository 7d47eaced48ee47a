"""Active sampling: keep enough prompt groups in flight to fill the next batch, adapting to
the fraction of groups that turn out useful, score each group as it finishes, and file it in
the buffer. Surplus useful groups stay in the buffer for the next step.

Groups are filed in the order they were submitted, whatever order the engines finish them
in, and every group carries a sampling seed derived from the run's seed and its submission
number. With `drain` (synchronous training) nothing is left in flight between steps, so the
groups a step trains on depend only on the seed and the weights: a resumed run sees the
same rollouts as an uninterrupted one."""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from typing import Awaitable, Callable

from megatron_rlvr.data import PromptRecord
from megatron_rlvr.rollout.manager import PromptItem, RolloutManager
from megatron_rlvr.samples import Group

class RolloutFailed(RuntimeError):
    """Every recent group failed: no engine can serve (the run stops instead of spinning)."""


class EnginesNeedWeights(RuntimeError):
    """Every engine is restarted and waiting for the current weights: only the learner can
    give them, so the caller syncs and asks again."""


Score = Callable[[list[str], list[str]], Awaitable[list[float]]]  # responses, golds → rewards


class ActiveSampler:
    def __init__(self, manager: RolloutManager, buffer, prompts: list[PromptRecord], *,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 score: Score, seed: int = 0, seeded: bool = True, max_in_flight: int = 256,
                 max_failed_in_a_row: int = 64):
        """buffer: a Buffer, or a proxy with the same async methods (the Ray actor)."""
        self.manager, self.buffer, self.score = manager, buffer, score
        self.prompts, self.encode, self.decode = prompts, encode, decode
        self.seed, self.seeded, self.max_in_flight = seed, seeded, max_in_flight
        self.max_failed_in_a_row, self._failed_in_a_row = max_failed_in_a_row, 0
        self._rng = random.Random(seed)
        self._order: list[PromptRecord] = []
        self._recent: deque[bool] = deque(maxlen=256)  # kept or not, for the latest groups
        self._pending: deque[str] = deque()  # group ids in flight, in submission order
        self._finished: dict[str, Group] = {}  # finished ahead of their turn
        self.submitted = 0
        self.rewards: list[float] = []  # every scored sample since the last take_rewards()
        self.tokens = 0  # response tokens generated since then

    def useful_fraction(self) -> float:
        """Kept / generated over the latest groups (the policy changes, so the fraction does),
        smoothed so a cold start neither stalls nor floods."""
        return (sum(self._recent) + 1) / (len(self._recent) + 2)

    def _next_prompt(self) -> PromptRecord:
        if not self._order:
            self._order = list(self.prompts)
            self._rng.shuffle(self._order)
        return self._order.pop()

    def _top_up(self, needed: int) -> None:
        target = min(self.max_in_flight, math.ceil(needed / self.useful_fraction()))
        while len(self._pending) < target:
            record = self._next_prompt()
            seed = (self.seed * 1_000_003 + self.submitted) % 2**62 if self.seeded else None
            self._pending.append(self.manager.submit(
                PromptItem(record.prompt_id, self.encode(record.prompt), record.answer, seed=seed)))
            self.submitted += 1

    async def _next_in_order(self) -> Group:
        head = self._pending[0]
        while head not in self._finished:
            group = await self.manager.next_group()
            self._finished[group.group_id] = group
        self._pending.popleft()
        return self._finished.pop(head)

    async def _file(self, group: Group) -> None:
        self._failed_in_a_row = self._failed_in_a_row + 1 if group.error is not None else 0
        if self._failed_in_a_row >= self.max_failed_in_a_row:
            raise RolloutFailed(f"the last {self._failed_in_a_row} groups all failed; latest: {group.error}")
        if group.samples and group.error is None:
            rewards = await self.score([self.decode(s.response_ids) for s in group.samples],
                                       [group.answer or ""] * len(group.samples))
            for sample, reward in zip(group.samples, rewards):
                sample.reward = reward
                self.tokens += len(sample.response_ids)
            self.rewards.extend(rewards)
        self._recent.append(await self.buffer.put(group) == "kept")

    async def fill(self, batch_groups: int, policy_version: int, *, drain: bool = False) -> list[Group]:
        """Exactly batch_groups useful groups for training `policy_version`. drain: also wait
        for every group still in flight (they go to the buffer), so none straddles a step."""
        while (useful := await self.buffer.useful(policy_version)) < batch_groups:
            if self.manager.serving == 0:
                await self.manager.wait_for_restarts()
                if self.manager.serving == 0 and self.manager.restarted:
                    raise EnginesNeedWeights("every engine was restarted and waits for the weights")
            self._top_up(batch_groups - useful)
            await self._file(await self._next_in_order())
        while drain and self._pending:
            await self._file(await self._next_in_order())
        return await self.buffer.get_batch(batch_groups, policy_version)

    def take_rewards(self) -> tuple[list[float], int]:
        """Rewards and response tokens since the last call."""
        rewards, tokens, self.rewards, self.tokens = self.rewards, self.tokens, [], 0
        return rewards, tokens

    def state(self) -> dict:
        """What a resumed run needs to submit the same groups next. Exact between drained
        steps; groups in flight (async runs) are not part of it and get regenerated."""
        return {"rng": self._rng.getstate(), "order": [r.prompt_id for r in self._order],
                "recent": list(self._recent), "submitted": self.submitted}

    def load_state(self, state: dict) -> None:
        by_id = {r.prompt_id: r for r in self.prompts}
        self._rng.setstate(state["rng"])
        self._order = [by_id[i] for i in state["order"]]
        self._recent = deque(state["recent"], maxlen=self._recent.maxlen)
        self.submitted = state["submitted"]
