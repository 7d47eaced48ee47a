"""Weight sync from the Megatron learner to real CPU engine processes over gloo, and the pure
parts of it: bucket packing, the update group's layout over (engines × tp × ep)."""

import asyncio
import subprocess
import sys

import httpx
import pytest
import torch
from distributed import run_ranks
from engine_fixtures import start_engine

from megatron_rlvr.config import WeightSyncConfig, load_config
from megatron_rlvr.launch.learners import engine_ranks
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.weight_sync.buckets import bucket_layout, buckets, pack, unpack
from megatron_rlvr.weight_sync.syncer import WeightSyncer, WeightSyncError
from megatron_rlvr.weight_sync.transport import bucket_device, engine_rank_count, group_layout


def test_buckets_keep_one_dtype_stay_under_the_limit_and_unpack_to_views():
    named = [(f"w{i}", torch.randn(10, 10)) for i in range(5)] + [
        ("b", torch.ones(7, dtype=torch.bfloat16)),
        ("big", torch.randn(100, 10)),
    ]
    out = list(buckets(named, max_bytes=1200))
    assert all(len({b.dtype}) == 1 for b in out)
    assert sorted(b.names for b in out) == [["b"], ["big"], ["w0", "w1", "w2"], ["w3", "w4"]]
    assert all(b.nbytes <= 1200 for b in out if b.names != ["big"])  # a larger tensor goes alone
    for bucket in out:
        views = unpack(bucket.buffer, [bucket.dtype] * len(bucket.names), bucket.shapes)
        for name, view in zip(bucket.names, views):
            assert torch.equal(view, dict(named)[name])
            assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()


def test_layout_refuses_unaligned_mixed_dtypes():
    with pytest.raises(ValueError, match="unaligned"):
        bucket_layout([torch.bfloat16, torch.float32], [[3], [2]])
    with pytest.raises(ValueError, match="one dtype"):
        pack([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.float64))])


@pytest.mark.parametrize(
    "engines, tp, ep, world, offsets",
    [
        (4, 4, 1, 17, [1, 5, 9, 13]),  # configs/qwen3-30b-a3b-grpo-r3.yaml: 4 engines × TP4
        (4, 4, 4, 17, [1, 5, 9, 13]),  # expert parallel inside each engine's TP ranks
        (8, 8, 1, 65, [1, 9, 17, 25, 33, 41, 49, 57]),  # configs/qwen3-235b-a22b-gspo.yaml: 8 engines × TP8
        (8, 8, 8, 65, [1, 9, 17, 25, 33, 41, 49, 57]),
        (2, 1, 1, 3, [1, 2]),  # the CPU tests: one rank per engine
        (1, 2, 1, 3, [1]),  # one SGLang tp 2 engine on CPU (tests/test_sglang_cpu.py)
    ],
)
def test_update_group_holds_the_sender_and_every_rank_of_every_engine(engines, tp, ep, world, offsets):
    layout = group_layout([engine_rank_count(tp, ep)] * engines)
    assert layout.world_size == world == 1 + engines * tp and layout.offsets == offsets
    ranks = [offset + tp_rank for offset in layout.offsets for tp_rank in range(tp)]  # SGLang: offset + tp_rank
    assert sorted(ranks) == list(range(1, world))  # each once, none out of range, rank 0 is the learner


def test_update_group_of_mixed_engines_and_bad_layouts():
    assert group_layout([2, 1, 4]).offsets == [1, 3, 4]
    assert group_layout([2, 1, 4]).world_size == 8
    with pytest.raises(ValueError, match="ep must divide tp"):
        engine_rank_count(4, 3)
    with pytest.raises(ValueError, match="each must be >= 1"):
        group_layout([2, 0])


@pytest.mark.parametrize(
    "recipe, expected", [("qwen3-30b-a3b-grpo-r3", [4] * 4), ("qwen3-235b-a22b-gspo", [8] * 8), ("tiny-moe-cpu", [1])]
)
def test_the_learner_passes_each_engines_rank_count_to_the_syncer(recipe, expected):
    cfg = load_config(f"configs/{recipe}.yaml")
    assert engine_ranks(cfg, cfg.rollout.num_engines) == expected
    if recipe == "qwen3-30b-a3b-grpo-r3":
        assert group_layout(expected).offsets == [1, 5, 9, 13] and group_layout(expected).world_size == 17


def test_buckets_are_packed_on_the_update_groups_device():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5))]
    assert all(b.buffer.is_meta for b in buckets(named, 1 << 20, device="meta"))  # moved, then packed there
    assert all(b.buffer.device.type == "cpu" for b in buckets(named, 1 << 20, device=bucket_device("gloo")))


@pytest.fixture(scope="module")
def engines(tiny_hf_dir, tmp_path_factory):
    started = [start_engine(tiny_hf_dir, tmp_path_factory.mktemp(f"sync-engine{i}")) for i in range(2)]
    yield started
    for engine in started:
        engine.stop()


LAYOUTS = {
    "world1": (1, []),
    "tp2-sp": (2, ["parallel.tp=2"]),
    "ep2": (2, ["parallel.ep=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    # the engines capture routing: the probe replays it in the learner (weight_sync/probe.py)
    "world1-routed": (1, ["rollout.return_routed_experts=true"]),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_after_a_sync_every_engine_tensor_equals_the_learners(layout, engines, tiny_hf_dir, tmp_path):
    world, overrides = LAYOUTS[layout]
    urls = ",".join(e.url for e in engines)
    results = run_ranks(
        world, ["sync", str(tiny_hf_dir), "weight_sync.bucket_mb=0.05", *overrides], tmp_path, env={"ENGINE_URLS": urls}
    )
    source = results[0]
    assert source["checked"] == 2 * 45 and source["mismatched"] == []
    metrics = source["metrics"]
    assert metrics["weight_sync/buckets"] > 3  # small buckets: several, pipelined
    assert metrics["weight_sync/parity_max_gap"] <= 1e-5
    assert metrics["weight_sync/parity_routing_replayed"] == float(layout == "world1-routed")
    assert len(set(source["versions"])) == 1


def test_corrupted_bucket_and_skipped_version_are_detected(engines, tiny_hf_dir, tmp_path):
    r = run_ranks(
        1,
        ["sync-integrity", str(tiny_hf_dir), "weight_sync.bucket_mb=0.05"],
        tmp_path,
        env={"ENGINE_URLS": engines[0].url},
    )[0]
    assert "rejected bucket 0" in r["corrupted_error"] and "checksum mismatch" in r["corrupted_error"]
    assert r["version_after_corruption"] == r["versions"]  # kept its old version
    assert r["retry_metrics"]["weight_sync/parity_max_gap"] <= 1e-5  # a clean retry then succeeds
    assert "skipped or repeated an update" in r["skipped_error"]


def test_a_paused_cpu_engine_answers_health_as_sglang_does(engines):
    """Paused for a sync, the CPU engine's /health waits for the resume as SGLang's one-token
    generation does (no answer within a client's timeout), /ready says 503 and /ping 200, so
    EngineClient.state reads it as paused, not dead (test_sync_faults_sglang.py: SGLang)."""
    from megatron_rlvr.rollout.client import EngineState

    async def paused_answers():
        client = EngineClient(engines[0].url)
        try:
            await client.pause("retract")
            try:
                with pytest.raises(httpx.TimeoutException):
                    await client._http.get("/health", timeout=2.0)
                flags = [(await client._http.get(path)).status_code for path in ("/ready", "/ping")]
                state = await client.state()
            finally:
                await client.resume()
            return flags, state, await client.state()
        finally:
            await client.close()

    flags, paused, resumed = asyncio.run(paused_answers())
    assert flags == [503, 200] and paused is EngineState.PAUSED and resumed is EngineState.SERVING


def test_an_engine_that_refuses_a_bucket_is_caught_before_the_broadcast(engines, tiny_hf_dir):
    """The engine left the update group (it refuses at once: no such group): the sync stops
    within the refusal wait, naming the engine, without posting the broadcast it would never
    match (gloo would wait 300 s, NCCL until its watchdog), and the engine serves on."""
    from safetensors.torch import load_file

    weights = list(load_file(str(tiny_hf_dir / "model.safetensors")).items())[:3]
    engine = engines[0]

    async def refused_sync():
        client = EngineClient(engine.url)
        syncer = WeightSyncer(
            [client], WeightSyncConfig(bucket_mb=0.05, refusal_wait_s=5.0), group_name="refusal_test", checksums=True
        )
        try:
            await syncer.connect()
            version = syncer.version
            await client.destroy_weights_update_group("refusal_test")
            with pytest.raises(WeightSyncError) as err:
                await syncer.sync(weights, version + 1)
            return str(err.value), version
        finally:
            await client.close()

    message, version = asyncio.run(refused_sync())
    # the engine's refusal itself, before any broadcast (not a broadcast left waiting for it)
    assert f"engine {engine.url} refused bucket 0" in message and "before its broadcast was posted" in message
    assert "no weight update group named 'refusal_test'" in message
    info = httpx.get(f"{engine.url}/model_info", timeout=10).json()
    assert info["weight_version"] == str(version)  # nothing loaded
    row = httpx.post(
        f"{engine.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=60
    )
    assert row.status_code == 200  # resumed, not left paused


def test_an_engine_that_dies_as_the_sync_begins_is_lost_not_refused(tiny_hf_dir, tmp_path):
    """SIGKILL of the engine between the survey and the first bucket (a real server, killed at
    that moment): the sync ends with EnginesLost, which the run survives by restarting the engine
    and syncing again, not with a refusal that would end the run; it finishes the export's
    stream on the way (other learner ranks are inside its collectives)."""
    import signal

    from safetensors.torch import load_file

    from megatron_rlvr.weight_sync.syncer import EnginesLost

    engine = start_engine(tiny_hf_dir, tmp_path)
    weights = list(load_file(str(tiny_hf_dir / "model.safetensors")).items())
    drawn = []

    class DiesOnUpdate(EngineClient):
        async def update_weights_from_distributed(self, request):
            engine.proc.send_signal(signal.SIGKILL)
            engine.proc.wait(30)
            return await super().update_weights_from_distributed(request)

    def stream():
        for item in weights:
            drawn.append(item[0])
            yield item

    async def sync_into_a_dying_engine():
        client = DiesOnUpdate(engine.url)
        syncer = WeightSyncer([client], WeightSyncConfig(bucket_mb=0.05, refusal_wait_s=5.0), group_name="dies_test")
        try:
            await syncer.connect()
            with pytest.raises(EnginesLost) as err:
                await syncer.sync(stream(), syncer.version + 1)
            return str(err.value)
        finally:
            await client.close()

    try:
        message = asyncio.run(sync_into_a_dying_engine())
    finally:
        engine.stop()
    assert f"engine {engine.url} died before bucket 0" in message
    assert drawn == [name for name, _ in weights]  # the whole export was drawn


# DeepSeek-V3: the expert score bias and MLA tensors; Mixtral: block_sparse_moe…w1/w3/w2 names
SYNC_FAMILIES = [
    pytest.param("deepseek_v3", "world1", id="deepseek_v3-world1"),
    pytest.param("mixtral", "world1", id="mixtral-world1"),
    pytest.param("deepseek_v3", "ep2", id="deepseek_v3-ep2", marks=pytest.mark.slow),
    pytest.param("glm4_moe", "world1", id="glm4_moe-world1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family, layout", SYNC_FAMILIES)
def test_a_sync_puts_every_learner_tensor_of_each_family_into_the_engine(family, layout, family_dir, tmp_path):
    from safetensors import safe_open

    model_dir = family_dir(family)
    engine = start_engine(model_dir, tmp_path / "engine")
    try:
        world, overrides = LAYOUTS[layout]
        source = run_ranks(
            world,
            ["sync", str(model_dir), "weight_sync.bucket_mb=0.05", *overrides],
            tmp_path,
            env={"ENGINE_URLS": engine.url},
        )[0]
    finally:
        engine.stop()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert source["checked"] == len(list(f.keys()))  # every exported tensor, bias included
    assert source["mismatched"] == []


def test_a_gpt_oss_sync_puts_every_learner_tensor_into_the_engine(tiny_gpt_oss_dir, tmp_path):
    """Fused expert tensors, biases and attention sinks: every exported tensor lands in the
    engine bitwise, after a train step (world 1, several small buckets)."""
    engine = start_engine(tiny_gpt_oss_dir, tmp_path)
    try:
        source = run_ranks(
            1, ["sync", str(tiny_gpt_oss_dir), "weight_sync.bucket_mb=0.05"], tmp_path, env={"ENGINE_URLS": engine.url}
        )[0]
    finally:
        engine.stop()
    assert source["checked"] == 37 and source["mismatched"] == []
    assert source["metrics"]["weight_sync/parity_max_gap"] <= 1e-5


def test_an_engine_killed_mid_broadcast_is_restarted_and_the_same_version_synced_again(engines, tiny_hf_dir):
    """Two real engines; one is SIGKILLed as bucket 2 is announced (buckets 0 and 1 were
    broadcast to both and loaded). The sync ends with EnginesLost, not a refusal, the
    export drawn whole; the survivor's session is closed and it stays paused. As the run
    does (Run.sync_weights): the dead engine is restarted, the same version is synced again
    over the engines alive (the survivor, holding part of it, gets all of it), and the next
    sync takes the restarted engine back: both hold every tensor of the last version and
    serve it, and the group in flight on the killed engine finishes on the other."""
    import signal

    from safetensors.torch import load_file

    from megatron_rlvr.rollout import protocol as p
    from megatron_rlvr.rollout.manager import PromptItem, RolloutManager
    from megatron_rlvr.weight_sync.syncer import EnginesLost

    for engine in engines:  # the version a restarted engine comes back with
        assert httpx.post(f"{engine.url}/update_weight_version", json={"new_version": "0"}).status_code == 200
    base = list(load_file(str(tiny_hf_dir / "model.safetensors")).items())
    announced = []

    def weights(version: int) -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor + 0.01 * version) for name, tensor in base]

    class DiesOnBucket2(EngineClient):
        async def update_weights_from_distributed(self, request):
            announced.append(request.names[0])
            if len(announced) == 3 and engines[1].alive:
                engines[1].proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(engines[1].proc.wait, 30)
            return await super().update_weights_from_distributed(request)

    async def restart(engine: int) -> str:
        how = engines[engine].exit_description()
        await asyncio.to_thread(engines[engine].start, 120)
        return how

    async def scenario():
        clients = [EngineClient(engines[0].url), DiesOnBucket2(engines[1].url)]
        long = p.SamplingParams(max_new_tokens=400, ignore_eos=True, n=2)  # still running when the kill lands
        manager = RolloutManager(clients, long, restart=restart)
        syncer = WeightSyncer(clients, WeightSyncConfig(bucket_mb=0.05), group_name="mid_broadcast")
        drawn: list[str] = []

        def stream(version):
            for name, tensor in weights(version):
                drawn.append(name)
                yield name, tensor

        try:
            await syncer.connect()
            v = syncer.version + 1
            manager.submit(PromptItem("p0", [1, 2, 3]))  # least busy first: one group each
            manager.submit(PromptItem("p1", [4, 5, 6]))
            with pytest.raises(EnginesLost) as lost:
                await syncer.sync(stream(v), v)
            assert drawn == [name for name, _ in base]  # the export finished: other ranks are inside it
            survivor = (await clients[0].model_info())["weight_version"]
            assert survivor in (str(v - 1), str(v))  # part of v loaded, session closed
            await manager.restart_unanswering()  # as the run does; the group's failure may have seen it first
            assert manager.serving == 1  # engine 1 restarting
            retry = await syncer.sync(stream(v), v)  # the survivor alone, the whole of v again
            assert retry.engine_version == v and syncer.members == [0]
            while manager._restarting:
                await asyncio.sleep(0.2)
            report = await syncer.sync(stream(v + 1), v + 1)  # the restarted engine joins
            assert syncer.members == [0, 1] and report.engine_version == v + 1
            assert await manager.readmit(v + 1) == [1] and manager.serving == 2
            held = {}
            for client in clients:
                for name, tensor in weights(v + 1):
                    got = await client._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": 10**9})
                    held[(client.base_url, name)] = torch.equal(torch.tensor(got).view_as(tensor), tensor)
            groups = [await manager.next_group(timeout_s=120) for _ in range(2)]
            return str(lost.value), held, groups, dict(manager.stats)
        finally:
            await syncer.close()
            for client in clients:
                await client.close()

    message, held, groups, stats = asyncio.run(scenario())
    assert f"engine {engines[1].url} died during the sync, at bucket 2" in message
    assert all(held.values()) and len(held) == 2 * len(base)
    assert all(g.error is None and len(g.samples) == 2 for g in groups)  # none lost
    assert stats["moved"] == 1 and stats.get("failed", 0) == 0


def test_a_survivor_that_cannot_close_its_session_is_named_for_restart_and_kept_out(engines, tiny_hf_dir, tmp_path):
    """Engine B dies as bucket 2 is announced; survivor A never answers the session's close,
    as an SGLang survivor inside a lost NCCL broadcast would not (NCCL only: its scheduler
    waits for the group's 30-minute timeout; stood in for here by a close that never returns).
    EnginesLost names both for restart, and the next sync keeps A out of the group until the
    run says it restarted A: it finds no engine to sync."""
    import signal

    from safetensors.torch import load_file

    from megatron_rlvr.weight_sync.syncer import EnginesLost

    dying = start_engine(tiny_hf_dir, tmp_path)
    weights = list(load_file(str(tiny_hf_dir / "model.safetensors")).items())
    announced = []
    # the module's engine carries whatever version earlier tests left; the new one starts at 0
    assert httpx.post(f"{engines[0].url}/update_weight_version", json={"new_version": "0"}).status_code == 200

    class StuckSurvivor(EngineClient):
        async def update_weights_from_distributed(self, request):
            announced.append(request.names[0])
            if len(announced) == 3 and dying.alive:
                dying.proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(dying.proc.wait, 30)
            return await super().update_weights_from_distributed(request)

        async def end_weight_update(self):
            await asyncio.sleep(3600)

    async def scenario():
        clients = [StuckSurvivor(engines[0].url), EngineClient(dying.url)]
        syncer = WeightSyncer(
            clients, WeightSyncConfig(bucket_mb=0.05, engine_wait_s=1), group_name="stuck_survivor", session_close_s=2
        )
        try:
            await syncer.connect()
            version = syncer.version + 1
            with pytest.raises(EnginesLost) as lost:
                await syncer.sync(weights, version)
            with pytest.raises(WeightSyncError) as none_left:
                await syncer.sync(weights, version)
            return lost.value, str(none_left.value), set(syncer.stuck)
        finally:
            # whatever session is left open (a restart would have cleared it)
            await asyncio.gather(EngineClient.end_weight_update(clients[0]), return_exceptions=True)
            await clients[0].resume()
            await syncer.close()
            for client in clients:
                await client.close()

    try:
        lost, none_left, stuck = asyncio.run(scenario())
    finally:
        dying.stop()
    assert lost.restart == (1, 0) and stuck == {0}
    assert f"engine {engines[0].url} did not close its update session within 2 s" in str(lost)
    assert "no engine is alive to receive weights" in none_left


STUCK_SYNC = """
import asyncio, sys
import torch
from safetensors.torch import load_file
from megatron_rlvr.config import WeightSyncConfig
from megatron_rlvr.rollout.client import EngineClient, EngineUnavailable
from megatron_rlvr.weight_sync.syncer import WeightSyncer, WeightSyncError

class LosesBucket1(EngineClient):
    async def update_weights_from_distributed(self, request):
        if request.names == ["big"]:  # never reaches the engine: it never posts its side
            raise EngineUnavailable(f"{self.base_url}/update_weights_from_distributed: lost on the way")
        return await super().update_weights_from_distributed(request)

async def main(url, model_dir):
    client = LosesBucket1(url)
    syncer = WeightSyncer([client], WeightSyncConfig(bucket_mb=0.05), group_name="stuck_test")
    await syncer.connect()
    first = list(load_file(model_dir + "/model.safetensors").items())[:1]
    try:
        await syncer.sync(first + [("big", torch.zeros(2**24))], syncer.version + 1)
    except WeightSyncError as err:
        print(err)
    await client.close()  # the engine keeps the group, as a hung one would

asyncio.run(main(*sys.argv[1:]))
"""


def test_a_broadcast_nobody_matches_does_not_keep_the_process_alive(engines, tiny_hf_dir, tmp_path):
    """A 64 MiB bucket's announcement is lost on its way to a live engine, which keeps the
    group and never posts its side: the learner's broadcast waits for it (gloo: up to the
    group's 300 s timeout). The sync ends with the engine named, and the process ends at once
    (a broadcast in asyncio.to_thread's executor kept it alive until that timeout)."""
    script = tmp_path / "stuck_sync.py"
    script.write_text(STUCK_SYNC)
    try:
        done = subprocess.run(
            [sys.executable, str(script), engines[0].url, str(tiny_hf_dir)], capture_output=True, text=True, timeout=150
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process outlived its failed sync by minutes: its broadcast thread kept it alive")
    finally:
        httpx.post(f"{engines[0].url}/destroy_weights_update_group", json={"group_name": "stuck_test"}, timeout=10)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rejected bucket 1 (1 tensors, first big) after its broadcast was posted" in done.stdout
