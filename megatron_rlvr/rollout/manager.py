"""The rollout manager: spreads prompt groups over the engines, hands each group to its
consumer the moment it finishes, and keeps going when an engine dies.

A request that fails at the connection level is not yet a dead engine: a keep-alive
connection closed under the client looks the same. The engine's state decides
(EngineClient.state: serving and paused are alive): if alive, the group is retried there; if not, the engine is restarted (when a restarter is
given) and the group moves to another serving engine, or, when none serves, waits until one
does again (a restarted engine serves once it holds the run's current weights: see readmit).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rlvr.agent.tools import ToolInfraError
from megatron_rlvr.loop_metrics import BusyClock
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient, EngineRequestError, EngineUnavailable
from megatron_rlvr.rollout.routed_experts import RoutedExpertsError, decode_routed_experts
from megatron_rlvr.samples import Group, Sample

if TYPE_CHECKING:
    from megatron_rlvr.agent.runner import AgentRunner

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """A group's request could not be served (its message says why)."""


class ToolsFailed(GroupFailed):
    """An episode's tool machinery failed on every try."""


class EnginesNeedWeights(RuntimeError):
    """Every engine was restarted and waits for the run's current weights: only the learner
    can give them, so the caller syncs, and the groups waiting for an engine go on."""


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
    messages: list[dict] | None = None  # the conversation, for an episode (agent on): it renders its own prompt
    extra: dict | None = None  # the record's extra_info (tools_kwargs)


class RolloutManager:
    def __init__(
        self,
        clients: list[EngineClient],
        sampling: p.SamplingParams,
        *,
        routing: RoutingShape | None = None,
        max_attempts: int = 3,
        restart: Callable[[int], Awaitable[str | None]] | None = None,
        serving_wait_s: float = 1800.0,
        agent: AgentRunner | None = None,
    ):
        """restart(engine) brings a dead engine's server back and says how the old one ended
        (None: it was alive, only slow, and was left alone). max_attempts: failures a group
        may meet before it fails. serving_wait_s: how long a group waits for an engine to
        serve again when none does (restart, then the learner's weights). agent: groups of
        prompts with messages run as episodes (agent/)."""
        if not clients:
            raise ValueError("the rollout manager needs at least one engine")
        self.clients = clients
        self.sampling = sampling
        self.routing = routing
        self.max_attempts = max_attempts
        self.restart = restart
        self.serving_wait_s = serving_wait_s
        self.agent = agent
        self._aborts = 0  # abort_all calls: an episode started before one ends at its next turn
        self.finished: asyncio.Queue[Group] = asyncio.Queue()
        self.stats: Counter[str] = Counter()  # moved (to another engine), retried (same engine), failed, aborted
        self._tasks: set[asyncio.Task] = set()
        self._restarts: set[asyncio.Task] = set()
        self._restarting: set[int] = set()
        self.restarted: set[int] = set()  # back up, but holding initial weights
        self._weights_needed = asyncio.Event()  # set while every engine waits for weights
        self._current_version: str | None = None  # the policy version the last sync pushed
        self.busy = [BusyClock() for _ in clients]  # per engine: time with a request running

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def serving(self) -> int:
        """Engines taking work: not restarting, and not waiting for the run's weights."""
        return len(self.clients) - len(self._restarting | self.restarted)

    def submit(
        self,
        item: PromptItem,
        n: int | None = None,
        *,
        sampling: p.SamplingParams | None = None,
        to: asyncio.Queue | None = None,
    ) -> str:
        """Starts generating n samples of one prompt; the group arrives on `finished`, or on
        `to` (evaluation: its own sampling, its own queue)."""
        group_id = uuid.uuid4().hex
        task = asyncio.create_task(
            self._run_group(
                item, group_id, n or (sampling or self.sampling).n, sampling or self.sampling, to or self.finished
            )
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return group_id

    async def next_group(self, timeout_s: float | None = None) -> Group:
        """The next finished group. Raises EnginesNeedWeights instead when no engine serves
        and every one of them is back but waits for the run's weights (groups waiting for an
        engine would otherwise wait for ever), and TimeoutError after timeout_s."""
        get = asyncio.ensure_future(self.finished.get())
        needed = asyncio.ensure_future(self._weights_needed.wait())
        try:
            done, _ = await asyncio.wait({get, needed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            needed.cancel()
            if not get.done():
                get.cancel()
        if get in done:
            return get.result()
        if needed in done:
            raise EnginesNeedWeights("every engine was restarted and waits for the run's weights")
        raise TimeoutError(f"no group finished within {timeout_s} s")

    async def abort_all(self) -> None:
        """Aborts every outstanding request; their groups arrive marked aborted (an episode
        running tools ends before its next turn)."""
        self._aborts += 1
        await asyncio.gather(*(c.abort(abort_all=True) for c in self.clients if c.healthy), return_exceptions=True)

    def _serving(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self._restarting | self.restarted]

    def _pick(self, avoid: int | None = None) -> int | None:
        """The least busy serving engine other than `avoid`, healthy ones first."""
        usable = [i for i in self._serving() if i != avoid]
        candidates = [i for i in usable if self.clients[i].healthy] or usable
        return min(candidates, key=lambda i: self.clients[i].in_flight) if candidates else None

    async def _wait_for_a_serving_engine(self, group_id: str) -> int | None:
        """When no engine serves (the only one died): waits, bounded, until one does again."""
        deadline = time.monotonic() + self.serving_wait_s
        while (engine := self._pick()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        if engine is None:
            log.error("group %s: no engine served again within %.0f s", group_id, self.serving_wait_s)
        return engine

    async def _run_group(
        self, item: PromptItem, group_id: str, n: int, sampling: p.SamplingParams, finished: asyncio.Queue
    ) -> None:
        if self.agent is not None and item.messages is not None:
            await finished.put(await self._run_episodes(item, group_id, n, sampling))
            return
        request = p.GenerateReqInput(
            input_ids=item.input_ids,
            rid=group_id,
            return_logprob=True,
            sampling_params=sampling.model_copy(update={"n": n, "sampling_seed": item.seed}),
            return_routed_experts=self.routing is not None,
        )
        try:
            responses, engine = await self._generate(request, group_id)
            group = self._group(item, group_id, responses, engine)
        except (GroupFailed, RoutedExpertsError) as err:
            await finished.put(self._failed(item, group_id, str(err)))
            return
        self.stats["aborted"] += group.aborted
        await finished.put(group)

    def _failed(self, item: PromptItem, group_id: str, error: str) -> Group:
        self.stats["failed"] += 1
        log.error("group %s failed: %s", group_id, error)
        return Group(item.prompt_id, group_id, [], item.answer, error=error)

    async def _generate(
        self, request: p.GenerateReqInput, group_id: str, engine: int | None = None
    ) -> tuple[list[p.GenerateResponse], int]:
        """The engine's answer to one request and the engine that gave it, with the failover
        the module describes; GroupFailed once max_attempts connection failures are spent, an
        engine refuses the request, or none serves within serving_wait_s."""
        failures, error = 0, "no engine available"
        engine = self._pick() if engine is None else engine
        while failures < self.max_attempts:
            if engine is None:
                engine = await self._wait_for_a_serving_engine(group_id)
                if engine is None:
                    break
            try:
                self.busy[engine].start()
                try:
                    return await self.clients[engine].generate(request), engine
                finally:
                    self.busy[engine].stop()
            except EngineUnavailable as err:
                failures, error = failures + 1, str(err)
                engine = await self._after_connection_failure(engine, group_id, err)
            except EngineRequestError as err:
                raise GroupFailed(str(err)) from None
        raise GroupFailed(error)

    async def _run_episodes(self, item: PromptItem, group_id: str, n: int, sampling: p.SamplingParams) -> Group:
        """n independent episodes of one prompt, run concurrently; each turn's request has the
        failover of a single-turn group. An episode whose tool machinery fails is run again,
        up to agent.max_episode_attempts times; then the group fails (counted as tool_failed)."""
        assert self.agent is not None
        agent = self.agent
        assert item.messages is not None
        messages = item.messages
        sampling = sampling.model_copy(update={"sampling_seed": item.seed})
        aborts = self._aborts

        async def one(index: int) -> Sample:
            engine: int | None = None  # an episode's turns stay on one engine (its prefix cache)

            async def generate(request: p.GenerateReqInput) -> p.GenerateResponse:
                nonlocal engine
                responses, engine = await self._generate(request, group_id, engine)
                return responses[0]

            for attempt in range(1, agent.max_episode_attempts + 1):
                try:
                    episode = agent.episode(
                        generate,
                        self._decode_routing if self.routing else None,
                        aborted=lambda: self._aborts != aborts,
                    )
                    sample = await episode.run(
                        messages,
                        sampling,
                        extra=item.extra,
                        rid=f"{group_id}-{index}",
                        prompt_id=item.prompt_id,
                        group_id=group_id,
                        index=index,
                    )
                except ToolInfraError as err:
                    self.stats["tool_retried"] += attempt < agent.max_episode_attempts
                    log.warning(
                        "group %s episode %d: tool machinery failed (try %d): %s", group_id, index, attempt, err
                    )
                    if attempt == agent.max_episode_attempts:
                        raise ToolsFailed(f"the tools failed {attempt} times: {err}") from None
                    continue
                sample.engine = self.clients[engine].base_url if engine is not None else ""
                return sample
            raise AssertionError("unreachable")

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            samples = await asyncio.gather(*tasks)
        except (GroupFailed, RoutedExpertsError) as err:
            self.stats["tool_failed"] += isinstance(err, ToolsFailed)  # groups, not episodes
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return self._failed(item, group_id, str(err))
        group = Group(item.prompt_id, group_id, list(samples), item.answer)
        group.aborted = any(s.finish_reason == "abort" for s in samples)
        self.stats["aborted"] += group.aborted
        return group

    def _decode_routing(self, meta: p.MetaInfo, label: str):
        assert self.routing is not None
        if meta.routed_experts is None:
            raise RoutedExpertsError(
                f"sample {label}: the engine returned no routed_experts (start it with --enable-return-routed-experts)"
            )
        return decode_routed_experts(
            meta.routed_experts,
            num_layers=self.routing.num_layers,
            top_k=self.routing.top_k,
            num_experts=self.routing.num_experts,
            sample=label,
        )

    async def _after_connection_failure(self, engine: int, group_id: str, err: Exception) -> int | None:
        """Where a group goes after its request to `engine` failed at the connection level:
        the same engine if it is alive (counted as retried), else another serving
        engine (counted as moved) while this one restarts, else None (wait for one)."""
        if await self.clients[engine].health():
            self.stats["retried"] += 1
            log.warning("engine %d dropped group %s but is alive: retrying there (%s)", engine, group_id, err)
            return engine
        self._schedule_restart(engine)
        other = self._pick(avoid=engine)
        if other is not None:
            self.stats["moved"] += 1
            log.warning("engine %d is down: group %s moves to engine %d (%s)", engine, group_id, other, err)
        else:
            log.warning(
                "engine %d is down and no other engine serves: group %s waits for it (%s)", engine, group_id, err
            )
        return other

    def _group(self, item: PromptItem, group_id: str, responses: list[p.GenerateResponse], engine: int) -> Group:
        samples = []
        for index, response in enumerate(responses):
            meta = response.meta_info
            routed = self._decode_routing(meta, f"{group_id}/{index}") if self.routing is not None else None
            samples.append(
                Sample(
                    prompt_id=item.prompt_id,
                    group_id=group_id,
                    index=index,
                    prompt_ids=item.input_ids,
                    response_ids=response.output_ids,
                    rollout_logprobs=[float(row[0]) for row in meta.output_token_logprobs or []],
                    finish_reason=meta.finish_reason.type,
                    weight_version=meta.weight_version,
                    weight_versions=meta.weight_versions or [],
                    routed_experts=routed,
                    engine=self.clients[engine].base_url,
                )
            )
        aborted = any(s.finish_reason == "abort" for s in samples)
        return Group(item.prompt_id, group_id, samples, item.answer, aborted=aborted)

    def busy_fraction(self, wall_s: float) -> float:
        """The engines' mean share of `wall_s` with a request running, since the last call
        (each engine's at most 1: its clock is read a moment after `wall_s` was)."""
        if wall_s <= 0:
            return 0.0
        return sum(min(clock.take(), wall_s) for clock in self.busy) / (len(self.busy) * wall_s)

    async def pause_clocks(self) -> None:
        """A weight sync begins: while it holds the engines paused, their waiting requests
        count as idle in busy_fraction, not busy."""
        for clock in self.busy:
            clock.pause()

    async def resume_clocks(self, at: float | None = None) -> None:
        """The engines resumed, at `at` (time.monotonic()) if that was before now."""
        for clock in self.busy:
            clock.resume(at)

    async def restart_unanswering(self) -> list[int]:
        """Schedules a restart of every engine that is down (EngineClient.state: a paused one
        is not) and is not being restarted already; returns their indices. An engine that died
        between batches has no request to fail on, so the weight sync asks this before it
        waits for engines."""
        engines = [i for i in range(len(self.clients)) if i not in self._restarting]
        answers = await asyncio.gather(*(self.clients[i].health() for i in engines))
        dead = [i for i, alive in zip(engines, answers) if not alive]
        for engine in dead:
            log.warning(
                "engine %d (%s) is down before a weight sync: restarting it if its process died",
                engine,
                self.clients[engine].base_url,
            )
            self._schedule_restart(engine)
        return dead

    async def restart_engines(self, engines: Iterable[int]) -> None:
        """Schedules a restart of these engines although they answer: a weight sync left them
        inside a broadcast that lost its peer (NCCL: until its 30-minute timeout)."""
        for engine in engines:
            log.warning(
                "engine %d (%s) is stuck in a lost weight sync: restarting it", engine, self.clients[engine].base_url
            )
            self._schedule_restart(engine)

    def _schedule_restart(self, engine: int) -> None:
        if self.restart is None or engine in self._restarting:
            return
        self._restarting.add(engine)
        restart_engine = self.restart

        async def restart() -> None:
            try:
                how = await restart_engine(engine)
                if how is not None:
                    log.warning(
                        "engine %d (%s) %s\nrestarted: it serves again once it holds the run's weights",
                        engine,
                        self.clients[engine].base_url,
                        how,
                    )
                    self.restarted.add(engine)
                    # a weight sync may have reached it before its restart was seen to finish
                    if self._current_version is not None and await self.readmit(self._current_version):
                        return
                    if not self._serving() and not self._restarting - {engine}:
                        self._weights_needed.set()
            except Exception as err:  # the engine stays out; the others carry on
                log.error("engine %d could not be restarted: %s", engine, err)
            finally:
                self._restarting.discard(engine)

        task = asyncio.create_task(restart())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def waiting_for_weights(self) -> list[int]:
        """Engines restarted and back, not yet given the run's weights (on the rollout loop,
        which changes the set)."""
        return sorted(self.restarted)

    async def readmit(self, version: int | str) -> list[int]:
        """Restarted engines that now hold `version` (the weight sync reached them) take
        work again; returns their indices. `version` is the run's current one from now on."""
        self._current_version = str(version)
        back = []
        for engine in sorted(self.restarted):
            try:
                info = await self.clients[engine].model_info()
            except (EngineUnavailable, EngineRequestError):
                continue
            if info["weight_version"] == str(version):
                self.restarted.discard(engine)
                back.append(engine)
        if self._serving():
            self._weights_needed.clear()
        return back
