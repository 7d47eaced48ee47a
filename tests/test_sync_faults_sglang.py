"""Weight-sync faults against real SGLang 0.5.23 on CPU: two servers (one module fixture,
~2 GB and a minute or two each to start), in the weight-update group a run forms. SGLang's
/health generates a token and generation waits while paused, so these show what the
CPU engine's twins (tests/test_weight_sync.py) cannot on their own: an engine paused for a
sync reads as paused, not dead; a refused update is a refusal; an engine killed mid-broadcast
is the only one restarted, and the survivor leaves the broadcast and takes the same version
again. The kill comes last: it leaves the module one engine."""

import asyncio
import os
import secrets
import signal

import pytest
from engine_fixtures import start_sglang
from safetensors.torch import load_file

from megatron_rlvr.config import WeightSyncConfig
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient, EngineState
from megatron_rlvr.rollout.manager import RolloutManager
from megatron_rlvr.weight_sync.syncer import EnginesLost, WeightSyncer, WeightSyncError

pytestmark = pytest.mark.sglang

KEY = secrets.token_urlsafe(16)  # as a run's engines have one: /ping needs it, /ready not


@pytest.fixture(scope="module")
def servers(tiny_hf_dir, tmp_path_factory):
    started = []
    try:
        for i in range(2):
            started.append(start_sglang(tiny_hf_dir, tmp_path_factory.mktemp(f"sglang{i}"), api_key=KEY))
        yield started
    finally:
        for server in started:
            server.stop()


def weights(model_dir, shift: float) -> list:
    return [(name, tensor + shift) for name, tensor in load_file(str(model_dir / "model.safetensors")).items()]


def test_an_engine_paused_for_a_sync_reads_as_paused_in_every_pause_mode(servers):
    """What the syncer and the manager ask mid-sync: paused is alive (health() true), never
    down, and serving again after continue_generation."""

    async def states():
        client = EngineClient(servers[0].url, api_key=KEY)
        seen = {}
        try:
            seen["before"] = await client.state()
            for mode in ("in_place", "retract", "abort"):
                await client.pause(mode)
                seen[mode] = (await client.state(), await client.health())
                await client.resume()
            seen["after"] = await client.state()
        finally:
            await client.close()
        return seen

    seen = asyncio.run(states())
    assert seen["before"] is EngineState.SERVING and seen["after"] is EngineState.SERVING
    for mode in ("in_place", "retract", "abort"):
        assert seen[mode] == (EngineState.PAUSED, True), mode


def test_a_refused_update_is_reported_as_refused_and_both_engines_serve_on(servers, tiny_hf_dir):
    """Engine 0 left the update group (it refuses bucket 0: no such group) while engine 1
    accepted and posted its side: the sync ends as a refusal naming engine 0, not as lost
    engines; engine 1 leaves its wait (the group is dropped) and both are resumed."""

    async def refused():
        clients = [EngineClient(s.url, api_key=KEY) for s in servers]
        syncer = WeightSyncer(clients, WeightSyncConfig(bucket_mb=0.05, refusal_wait_s=5.0), group_name="refusal")
        try:
            await syncer.connect()
            await clients[0].destroy_weights_update_group("refusal")
            with pytest.raises(WeightSyncError) as err:
                await syncer.sync(weights(tiny_hf_dir, 0.01), syncer.version + 1)
            states = [await c.state() for c in clients]
            return err.value, states
        finally:
            await syncer.close()
            for client in clients:
                await client.close()

    err, states = asyncio.run(refused())
    assert not isinstance(err, EnginesLost), err
    assert f"engine {servers[0].url} refused bucket 0" in str(err) and "before its broadcast was posted" in str(err)
    assert states == [EngineState.SERVING, EngineState.SERVING]


def test_an_engine_killed_mid_broadcast_is_the_only_one_restarted_and_the_survivor_takes_the_version(
    servers, tiny_hf_dir
):
    """Engine 1's whole process group is SIGKILLed as bucket 2 is announced. The sync ends
    with EnginesLost naming engine 1 alone; the survivor, paused, reads as paused, so the
    run's health sweep restarts only engine 1; the survivor left the lost broadcast (it
    closes its session) and the same version, synced again over it alone, lands."""
    announced: list[str] = []

    class KillsEngine1OnBucket2(EngineClient):
        async def update_weights_from_distributed(self, request):
            announced.append(request.names[0])
            if len(announced) == 3 and servers[1].alive:
                os.killpg(servers[1].proc.pid, signal.SIGKILL)
                await asyncio.to_thread(servers[1].proc.wait, 30)
            return await super().update_weights_from_distributed(request)

    asked: list[int] = []

    async def restart(engine: int) -> None:
        asked.append(engine)  # a real restart is another minute of SGLang start-up: recorded only
        return None

    async def scenario():
        clients = [KillsEngine1OnBucket2(servers[0].url, api_key=KEY), EngineClient(servers[1].url, api_key=KEY)]
        manager = RolloutManager(clients, p.SamplingParams(max_new_tokens=4), restart=restart)
        syncer = WeightSyncer(clients, WeightSyncConfig(bucket_mb=0.05), group_name="mid_broadcast")
        try:
            await syncer.connect()
            version = syncer.version + 1
            with pytest.raises(EnginesLost) as lost:
                await syncer.sync(weights(tiny_hf_dir, 0.02), version)
            survivor = await clients[0].state()
            swept = await manager.restart_unanswering()  # what the run asks before it syncs again
            await asyncio.gather(*manager._restarts)
            retry = await syncer.sync(weights(tiny_hf_dir, 0.02), version)
            return lost.value, survivor, swept, retry, syncer.members
        finally:
            await syncer.close()
            for client in clients:
                await client.close()

    lost, survivor, swept, retry, members = asyncio.run(scenario())
    assert f"engine {servers[1].url} died during the sync, at bucket 2" in str(lost)
    assert servers[0].url not in str(lost) and lost.restart == (1,)
    assert survivor is EngineState.PAUSED
    assert swept == [1] and asked == [1]
    assert members == [0] and retry.engine_version == retry.version
