"""Active sampling: keep enough prompt groups in flight to fill the next batch, adapting to
the fraction of groups that turn out useful, score each group as soon as it finishes, and
file it in the buffer. Surplus useful groups stay in the buffer for the next step."""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from typing import Callable

from megatron_rlvr.buffer.buffer import Buffer
from megatron_rlvr.data import PromptRecord
from megatron_rlvr.rewards.math import MathVerifier
from megatron_rlvr.rollout.manager import PromptItem, RolloutManager
from megatron_rlvr.samples import Group


class ActiveSampler:
    def __init__(self, manager: RolloutManager, buffer: Buffer, prompts: list[PromptRecord], *,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 verifier: MathVerifier, seed: int = 0, max_in_flight: int = 256):
        self.manager, self.buffer, self.verifier = manager, buffer, verifier
        self.prompts, self.encode, self.decode = prompts, encode, decode
        self.max_in_flight = max_in_flight
        self._rng = random.Random(seed)
        self._order: list[PromptRecord] = []
        self._recent: deque[bool] = deque(maxlen=256)  # kept or not, for the latest groups
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
        while self.manager.in_flight < target:
            record = self._next_prompt()
            self.manager.submit(PromptItem(record.prompt_id, self.encode(record.prompt), record.answer))

    async def _score(self, group: Group) -> None:
        responses = [self.decode(s.response_ids) for s in group.samples]
        verdicts = await asyncio.to_thread(self.verifier.verify_batch, responses,
                                           [group.answer or ""] * len(responses))
        for sample, (reward, _) in zip(group.samples, verdicts):
            sample.reward = reward
            self.rewards.append(reward)
            self.tokens += len(sample.response_ids)

    async def fill(self, batch_groups: int, policy_version: int) -> list[Group]:
        """Exactly batch_groups useful groups for training `policy_version`."""
        while self.buffer.useful(policy_version) < batch_groups:
            self._top_up(batch_groups - self.buffer.useful(policy_version))
            group = await self.manager.next_group()
            if group.samples and group.error is None:
                await self._score(group)
            self._recent.append(await self.buffer.put(group) == "kept")
        return await self.buffer.get_batch(batch_groups, policy_version)

    def take_rewards(self) -> tuple[list[float], int]:
        """Rewards and response tokens since the last call."""
        rewards, tokens, self.rewards, self.tokens = self.rewards, self.tokens, [], 0
        return rewards, tokens
