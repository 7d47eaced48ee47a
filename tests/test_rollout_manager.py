"""The rollout manager over real CPU engine processes: failover, restart, abort."""

import asyncio
import os
import signal
import time

import pytest

from engine_fixtures import start_engine
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.manager import PromptItem, RolloutManager, RoutingShape

LONG = p.SamplingParams(max_new_tokens=400, ignore_eos=True, n=4)  # still running when the kill lands


@pytest.fixture
def two_engines(tiny_hf_dir, tmp_path):
    engines = [start_engine(tiny_hf_dir, tmp_path / f"e{i}") for i in range(2)]
    yield engines
    for engine in engines:
        engine.stop()


def test_an_engine_killed_mid_rollout_loses_no_group_and_is_restarted(two_engines):
    dead, alive = two_engines

    async def restart(index: int) -> bool:
        await asyncio.to_thread(two_engines[index].start, 120)
        return True

    async def run():
        clients = [EngineClient(e.url, timeout_s=60, retries=1, backoff_s=0.1) for e in two_engines]
        manager = RolloutManager(clients, LONG, routing=RoutingShape(2, 2, 4), restart=restart)
        for i in range(6):
            manager.submit(PromptItem(f"p{i}", [i + 1, 7, 3], answer=str(i)))
        await asyncio.sleep(0.3)  # every group is generating now
        os.killpg(dead.proc.pid, signal.SIGKILL)
        groups = [await manager.next_group(180) for _ in range(6)]
        assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(6)]
        for g in groups:
            assert g.error is None and len(g.samples) == 4 and not g.aborted
            for s in g.samples:
                assert len(s.response_ids) == 400 == len(s.rollout_logprobs)
                assert s.routed_experts.shape == (3 + 400 - 1, 2, 2) and s.weight_version == "0"
        assert manager.stats["moved"] >= 1 and manager.stats["failed"] == 0  # work moved, none lost
        assert clients[1].base_url in {s.engine for g in groups for s in g.samples}
        # the dead engine is restarted, and serves again once it holds the run's weights
        deadline = time.monotonic() + 120
        while 0 not in manager.restarted and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert dead.alive
        assert await manager.readmit(1) == [] and 0 in manager.restarted  # still initial weights
        assert await manager.readmit(0) == [0] and not manager.restarted
        rows = await clients[0].generate(p.GenerateReqInput(input_ids=[1, 2], sampling_params=p.SamplingParams(max_new_tokens=2)))
        assert len(rows[0].output_ids) == 2
        for c in clients:
            await c.close()

    asyncio.run(run())


def test_abort_all_returns_groups_marked_aborted(two_engines):
    async def run():
        clients = [EngineClient(e.url) for e in two_engines]
        manager = RolloutManager(clients, p.SamplingParams(max_new_tokens=480, ignore_eos=True, n=2))
        for i in range(4):
            manager.submit(PromptItem(f"p{i}", [i + 1, 2]))
        await asyncio.sleep(0.5)
        await manager.abort_all()
        groups = [await manager.next_group(60) for _ in range(4)]
        assert all(g.aborted and g.samples and g.error is None for g in groups)
        assert manager.stats["aborted"] == 4
        assert all(len(s.response_ids) < 480 for g in groups for s in g.samples)
        for c in clients:
            await c.close()

    asyncio.run(run())


def test_a_refused_request_becomes_a_group_with_the_error(two_engines):
    async def run():
        clients = [EngineClient(e.url) for e in two_engines]
        manager = RolloutManager(clients, p.SamplingParams(max_new_tokens=4))
        manager.submit(PromptItem("bad", [5000]))
        group = await manager.next_group(30)
        assert group.samples == [] and "outside the vocabulary" in group.error
        assert manager.stats["failed"] == 1
        for c in clients:
            await c.close()

    asyncio.run(run())
