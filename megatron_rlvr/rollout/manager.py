"""The rollout manager: spreads prompt groups over the engines, hands each group to its
consumer the moment it finishes, and keeps going when an engine dies (its groups move to the
others; the engine is restarted when a restarter is given, and serves again once it holds
the run's current weights: see readmit)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable

from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient, EngineRequestError, EngineUnavailable
from megatron_rlvr.rollout.routed_experts import RoutedExpertsError, decode_routed_experts
from megatron_rlvr.samples import Group, Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingShape:
    """What the model's routed experts look like, to decode and check them per sample."""

    num_layers: int
    top_k: int
    num_experts: int


@dataclass
class PromptItem:
    prompt_id: str
    input_ids: list[int]
    answer: str | None = None
    seed: int | None = None  # sampling seed of the group (the engine derives one per sample)


class RolloutManager:
    def __init__(self, clients: list[EngineClient], sampling: p.SamplingParams, *,
                 routing: RoutingShape | None = None, max_attempts: int = 3,
                 restart: Callable[[int], Awaitable[bool]] | None = None):
        """restart(engine) brings a dead engine's server back and says whether it had to (a
        server that is alive but slow to answer is left alone)."""
        if not clients:
            raise ValueError("the rollout manager needs at least one engine")
        self.clients = clients
        self.sampling = sampling
        self.routing = routing
        self.max_attempts = max_attempts
        self.restart = restart
        self.finished: asyncio.Queue[Group] = asyncio.Queue()
        self.stats: Counter[str] = Counter()  # moved (to another engine), failed, aborted
        self._tasks: set[asyncio.Task] = set()
        self._restarts: set[asyncio.Task] = set()
        self._restarting: set[int] = set()
        self.restarted: set[int] = set()  # back up, but holding initial weights

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def serving(self) -> int:
        """Engines taking work: not restarting, and not waiting for the run's weights."""
        return len(self.clients) - len(self._restarting | self.restarted)

    def submit(self, item: PromptItem, n: int | None = None) -> str:
        """Starts generating n samples of one prompt; the group arrives on `finished`."""
        group_id = uuid.uuid4().hex
        task = asyncio.create_task(self._run_group(item, group_id, n or self.sampling.n))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return group_id

    async def next_group(self, timeout_s: float | None = None) -> Group:
        return await asyncio.wait_for(self.finished.get(), timeout_s)

    async def abort_all(self) -> None:
        """Aborts every outstanding request; their groups arrive marked aborted."""
        await asyncio.gather(*(c.abort(abort_all=True) for c in self.clients if c.healthy),
                             return_exceptions=True)

    def _pick(self, tried: set[int]) -> int | None:
        usable = [i for i in range(len(self.clients)) if i not in tried and i not in self.restarted]
        candidates = [i for i in usable if self.clients[i].healthy] or usable
        return min(candidates, key=lambda i: self.clients[i].in_flight) if candidates else None

    async def _run_group(self, item: PromptItem, group_id: str, n: int) -> None:
        request = p.GenerateReqInput(
            input_ids=item.input_ids, rid=group_id, return_logprob=True,
            sampling_params=self.sampling.model_copy(update={"n": n, "sampling_seed": item.seed}),
            return_routed_experts=self.routing is not None,
        )
        tried: set[int] = set()
        error = "no engine available"
        for _ in range(self.max_attempts):
            engine = self._pick(tried)
            if engine is None:
                break
            tried.add(engine)
            try:
                responses = await self.clients[engine].generate(request)
                group = self._group(item, group_id, responses, engine)
            except EngineUnavailable as err:
                error = str(err)
                self.stats["moved"] += 1
                log.warning("engine %d failed group %s, moving it: %s", engine, group_id, err)
                self._schedule_restart(engine)
                continue
            except (EngineRequestError, RoutedExpertsError) as err:
                error = str(err)
                break
            self.stats["aborted"] += group.aborted
            await self.finished.put(group)
            return
        self.stats["failed"] += 1
        await self.finished.put(Group(item.prompt_id, group_id, [], item.answer, error=error))

    def _group(self, item: PromptItem, group_id: str, responses: list[p.GenerateResponse],
               engine: int) -> Group:
        samples = []
        for index, response in enumerate(responses):
            meta = response.meta_info
            routed = None
            if self.routing is not None:
                if meta.routed_experts is None:
                    raise RoutedExpertsError(f"sample {group_id}/{index}: the engine returned no "
                                             "routed_experts (start it with --enable-return-routed-experts)")
                routed = decode_routed_experts(meta.routed_experts, num_layers=self.routing.num_layers,
                                               top_k=self.routing.top_k, num_experts=self.routing.num_experts,
                                               sample=f"{group_id}/{index}")
            samples.append(Sample(
                prompt_id=item.prompt_id, group_id=group_id, index=index, prompt_ids=item.input_ids,
                response_ids=response.output_ids,
                rollout_logprobs=[float(row[0]) for row in meta.output_token_logprobs or []],
                finish_reason=meta.finish_reason.type, weight_version=meta.weight_version,
                weight_versions=meta.weight_versions or [], routed_experts=routed,
                engine=self.clients[engine].base_url,
            ))
        aborted = any(s.finish_reason == "abort" for s in samples)
        return Group(item.prompt_id, group_id, samples, item.answer, aborted=aborted)

    def _schedule_restart(self, engine: int) -> None:
        if self.restart is None or engine in self._restarting:
            return
        self._restarting.add(engine)

        async def restart() -> None:
            try:
                if await self.restart(engine):
                    self.restarted.add(engine)
            except Exception as err:  # the engine stays out; the others carry on
                log.error("engine %d could not be restarted: %s", engine, err)
            finally:
                self._restarting.discard(engine)

        task = asyncio.create_task(restart())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def wait_for_restarts(self) -> None:
        if self._restarts:
            await asyncio.gather(*self._restarts, return_exceptions=True)

    async def readmit(self, version: int | str) -> list[int]:
        """Restarted engines that now hold `version` (the weight sync reached them) take
        work again; returns their indices."""
        back = []
        for engine in sorted(self.restarted):
            try:
                info = await self.clients[engine].model_info()
            except (EngineUnavailable, EngineRequestError):
                continue
            if info["weight_version"] == str(version):
                self.restarted.discard(engine)
                back.append(engine)
        return back
