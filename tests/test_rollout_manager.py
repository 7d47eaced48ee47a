"""The rollout manager over real CPU engine processes: failover, restart, abort."""

import asyncio
import os
import signal
import time

import pytest
from engine_fixtures import start_engine

from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.manager import EnginesNeedWeights, PromptItem, RolloutManager, RoutingShape

LONG = p.SamplingParams(max_new_tokens=400, ignore_eos=True, n=4)  # still running when the kill lands


@pytest.fixture
def two_engines(tiny_hf_dir, tmp_path):
    engines = [start_engine(tiny_hf_dir, tmp_path / f"e{i}") for i in range(2)]
    yield engines
    for engine in engines:
        engine.stop()


def test_an_engine_killed_mid_rollout_loses_no_group_and_is_restarted(two_engines):
    dead, alive = two_engines

    async def restart(index: int) -> str:
        two_engines[index].proc.wait(10)
        how = two_engines[index].exit_description()
        await asyncio.to_thread(two_engines[index].start, 120)
        return how

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
        assert manager.stats["moved"] <= 6 and manager.stats["retried"] == 0  # a group moves once
        assert clients[1].base_url in {s.engine for g in groups for s in g.samples}
        # the dead engine is restarted, and serves again once it holds the run's weights
        deadline = time.monotonic() + 120
        while 0 not in manager.restarted and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert dead.alive
        assert await manager.readmit(1) == [] and 0 in manager.restarted  # still initial weights
        assert await manager.readmit(0) == [0] and not manager.restarted
        rows = await clients[0].generate(
            p.GenerateReqInput(input_ids=[1, 2], sampling_params=p.SamplingParams(max_new_tokens=2))
        )
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


def test_the_only_engine_killed_mid_rollout_loses_no_group(tiny_hf_dir, tmp_path, caplog):
    """Nowhere to move them: the groups wait for the restart, then for the run's weights
    (next_group says so: EnginesNeedWeights), and go on once the engine is readmitted."""
    engine = start_engine(tiny_hf_dir, tmp_path / "e0")

    async def restart(index: int) -> str:
        await asyncio.to_thread(engine.proc.wait, 10)
        how = engine.exit_description()
        await asyncio.to_thread(engine.start, 120)
        return how

    async def run():
        client = EngineClient(engine.url, timeout_s=60, retries=1, backoff_s=0.1)
        manager = RolloutManager([client], LONG, restart=restart)
        for i in range(3):
            manager.submit(PromptItem(f"p{i}", [i + 1, 7, 3]))
        await asyncio.sleep(0.3)
        os.killpg(engine.proc.pid, signal.SIGKILL)
        with pytest.raises(EnginesNeedWeights):
            await manager.next_group(180)
        assert manager.serving == 0 and manager.restarted == {0}
        assert await manager.readmit(0) == [0]  # the learner's sync reached it
        groups = [await manager.next_group(180) for _ in range(3)]
        assert all(g.error is None and len(g.samples) == 4 for g in groups)
        assert manager.stats["failed"] == 0 and manager.stats["moved"] == 0  # waited, did not move
        await client.close()

    try:
        with caplog.at_level("WARNING", logger="megatron_rlvr.rollout.manager"):
            asyncio.run(run())
    finally:
        engine.stop()
    assert "(http://127.0.0.1:" in caplog.text and "was killed by SIGKILL" in caplog.text  # how it died
    assert "no other engine serves: group" in caplog.text


class DropFirstConnection:
    """A TCP proxy on loopback that closes the first connection after reading the request, as
    an engine behind a load balancer or a reaped keep-alive connection does; later
    connections pass through."""

    def __init__(self, target_port: int):
        self.target_port, self.dropped = target_port, 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer):
        if self.dropped == 0:
            self.dropped += 1
            await reader.read(1024)
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True)


def test_a_dropped_connection_to_a_healthy_engine_is_retried_there(tiny_hf_dir, tmp_path):
    engine = start_engine(tiny_hf_dir, tmp_path / "e0")

    async def run():
        proxy = DropFirstConnection(engine.port)
        port = await proxy.start()
        restarts = []

        async def restart(index: int) -> str:
            restarts.append(index)
            return "restarted"

        client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=60, retries=0)
        manager = RolloutManager([client], p.SamplingParams(max_new_tokens=4, n=2), restart=restart)
        manager.submit(PromptItem("p", [1, 2, 3]))
        group = await manager.next_group(60)
        assert group.error is None and len(group.samples) == 2 and proxy.dropped == 1
        assert manager.stats["retried"] == 1 and manager.stats["moved"] == 0 and not restarts
        await client.close()
        proxy.server.close()

    try:
        asyncio.run(run())
    finally:
        engine.stop()
