"""rollout.updates = in_flight: every response token's policy version reaches the batch and
the step's staleness metrics; the sampler files groups as they finish and keeps the engine
generating between fills; the config refuses the combinations in-flight updates cannot honour."""

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from engine_fixtures import hf_teacher_forced, start_engine
from test_config import TINY, _problems

from megatron_rlvr.algo.from_config import advantage_options
from megatron_rlvr.batching import groups_to_batch
from megatron_rlvr.buffer.buffer import Buffer
from megatron_rlvr.config import AlgoConfig, WeightSyncConfig, load_config
from megatron_rlvr.data import PromptRecord
from megatron_rlvr.loop_metrics import BusyClock, staleness_metrics
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient, EngineRequestError
from megatron_rlvr.rollout.manager import PromptItem, RolloutManager, RoutingShape
from megatron_rlvr.rollout.sampler import ActiveSampler
from megatron_rlvr.samples import Group, Sample


def sample(index: int, response: list[int], spans: list[dict], reward: float) -> Sample:
    return Sample(
        prompt_id="p",
        group_id="g",
        index=index,
        prompt_ids=[1, 2],
        response_ids=response,
        rollout_logprobs=[-0.5] * len(response),
        finish_reason="stop",
        weight_version=spans[-1]["version"] if spans else "0",
        weight_versions=spans,
        reward=reward,
    )


def test_every_token_carries_its_version_into_the_batch_and_the_staleness_metrics():
    spanning = sample(
        0, [5, 6, 7, 8], [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 4}], 1
    )
    single = sample(1, [9, 9], [{"version": "3", "start": 0, "end": 2}], 0)
    assert spanning.token_versions() == [2, 2, 2, 3]
    batch = groups_to_batch([Group("p", "g", [spanning, single])], advantage=advantage_options(AlgoConfig()))
    assert batch.token_versions is not None
    assert batch.token_versions[0].tolist() == [-1, -1, 2, 2, 2, 3]
    assert batch.token_versions[1].tolist() == [-1, -1, 3, 3, -1, -1]
    metrics = staleness_metrics(batch, policy_version=4)
    assert metrics == {
        "staleness/min": 1.0,
        "staleness/mean": pytest.approx((3 * 2 + 3 * 1) / 6),
        "staleness/max": 2.0,
        "staleness/mixed_version_share": 0.5,
    }
    batch.response_mask[0, 2:5] = 0  # only the token of version 3 counts: no row mixes versions
    assert staleness_metrics(batch, 4)["staleness/mixed_version_share"] == 0.0


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_busy_clock_counts_overlapping_requests_once():
    t = FakeTime()
    clock = BusyClock(now=t)
    clock.start()
    clock.start()
    t.now = 2.0
    clock.stop()
    clock.stop()
    t.now = 5.0
    assert clock.take() == 2.0  # the idle stretch after both stopped does not count
    assert clock.take() == 0.0


def test_a_paused_engine_with_requests_waiting_counts_as_idle():
    """In flight a weight sync pauses the engine with requests still in it: they wait, the
    engine generates nothing, and the busy share must say so (it bounds what in flight gains)."""
    t = FakeTime()
    clock = BusyClock(now=t)
    clock.start()  # a request runs from 0
    t.now = 1.0
    clock.pause()  # the sync pauses the engine; the request waits in it
    t.now = 3.0
    clock.start()  # a request submitted during the sync waits too
    t.now = 4.0
    clock.resume()
    t.now = 4.5
    assert clock.take() == 1.5  # 0-1 and 4-4.5: the 3 s paused are idle
    t.now = 5.0
    clock.pause()
    t.now = 6.0
    assert clock.take() == 0.5  # 4.5-5; paused since
    t.now = 9.0
    clock.resume(at=7.0)  # the sync ended at 7; what came after it (the parity probe) ran beside requests
    assert clock.take() == 2.0
    clock.stop()
    clock.stop()
    t.now = 10.0
    assert clock.take() == 0.0
    clock.pause()
    clock.resume(at=9.5)  # nothing was running: nothing to count
    t.now = 11.0
    assert clock.take() == 0.0


PROMPTS = [PromptRecord(f"p{i}", str(i), str(i)) for i in range(16)]


@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory):
    server = start_engine(tiny_hf_dir, tmp_path_factory.mktemp("engine"), routed=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def routed_engine(tiny_hf_dir, tmp_path_factory):
    server = start_engine(tiny_hf_dir, tmp_path_factory.mktemp("routed"), routed=True)
    yield server
    server.stop()


def test_in_flight_sampling_keeps_generating_between_fills_and_loses_no_group(engine):
    async def score(responses, record):
        return [float(i % 2) for i in range(len(responses))]  # every group useful

    async def go():
        client = EngineClient(engine.url)
        manager = RolloutManager([client], p.SamplingParams(max_new_tokens=24, n=2, ignore_eos=True))
        buffer = Buffer(max_staleness=5)
        sampler = ActiveSampler(
            manager,
            buffer,
            PROMPTS,
            encode=lambda record: [1, 5 + int(record.prompt)],
            decode=lambda ids: "",
            score=score,
            in_flight=True,
        )
        try:
            first = await sampler.fill(2, policy_version=0)
            filed, submitted = buffer.counts["generated"], sampler.submitted
            deadline = time.monotonic() + 60
            while buffer.counts["generated"] <= filed:  # the engine goes on while "the learner trains"
                assert time.monotonic() < deadline, "no group was filed between fills"
                await asyncio.sleep(0.05)
            # the groups left in flight at the fill were not toward the next batch until filed, so
            # keeping busy topped up with more (how many are in flight at any instant is a race)
            assert sampler.submitted > submitted
            second = await sampler.fill(2, policy_version=1)
            assert len(first) == len(second) == 2
            assert not {g.group_id for g in first} & {g.group_id for g in second}
            await sampler.stop_generating()
            assert manager.in_flight == 0
            assert buffer.counts["generated"] == sampler.submitted  # used, waiting or dropped: counted
        finally:
            await client.close()

    asyncio.run(go())


def test_groups_cut_off_in_flight_by_a_checkpoint_are_generated_again_first_on_resume(engine):
    """A checkpoint cannot hold half-made groups: it records their prompts, and the resumed
    sampler submits those before any other, in their order (nothing is lost silently)."""

    async def score(responses, record):
        return [float(i % 2) for i in range(len(responses))]  # every group useful

    def sampler_for(manager, in_flight):
        return ActiveSampler(
            manager,
            Buffer(max_staleness=5),
            PROMPTS,
            encode=lambda record: [1, 5 + int(record.prompt)],
            decode=lambda ids: "",
            score=score,
            in_flight=in_flight,
        )

    async def go():
        client = EngineClient(engine.url)
        manager = RolloutManager([client], p.SamplingParams(max_new_tokens=16, n=2, ignore_eos=True))
        try:
            before = sampler_for(manager, in_flight=True)
            taken = await before.fill(2, policy_version=0)  # 4 submitted at the cold start's useful fraction
            state = before.state()  # as finish_step takes it, with the other 2 still generating
            await before.stop_generating()
            cut_off = state["in_flight"]
            assert len(cut_off) == 2 and not set(cut_off) & {g.prompt_id for g in taken}
            resumed = sampler_for(manager, in_flight=False)
            assert resumed.load_state(state) == 2
            again = await resumed.fill(2, policy_version=1, drain=True)
            assert [g.prompt_id for g in again] == cut_off
        finally:
            await client.close()

    asyncio.run(go())


def test_a_checkpoint_taken_while_a_group_is_scored_loses_no_prompt_on_resume(engine):
    """The run's checkpoint (Run.finish_step) takes the sampler's and the buffer's state with
    sampler.snapshot(). A group taken from the engine but still being scored is in neither
    the engine's queue nor the buffer: it must be in the snapshot's in_flight, so every prompt
    submitted before the snapshot is trained, waiting in the buffer, or generated again."""
    submitted: list[str] = []
    hold, held, release = False, asyncio.Event(), asyncio.Event()

    async def score(responses, record):
        if hold and not held.is_set():  # the first group scored after the fill waits here
            held.set()
            await release.wait()
        return [float(i % 2) for i in range(len(responses))]  # every group useful

    def sampler_for(manager, buffer, in_flight):
        def encode(record):
            submitted.append(record.prompt_id)
            return [1, 5 + int(record.prompt)]

        return ActiveSampler(
            manager, buffer, PROMPTS, encode=encode, decode=lambda ids: "", score=score, in_flight=in_flight
        )

    async def go():
        nonlocal hold
        client = EngineClient(engine.url)
        manager = RolloutManager([client], p.SamplingParams(max_new_tokens=16, n=2, ignore_eos=True))
        try:
            before = sampler_for(manager, Buffer(max_staleness=5), in_flight=True)
            trained = await before.fill(2, policy_version=0)  # the learner "trains" these
            hold = True  # keeping busy, the sampler files the next group to finish: it is held scoring
            await asyncio.wait_for(held.wait(), timeout=120)
            state, buffer_state, drawn = await before.snapshot()  # the checkpoint, taken now
            release.set()
            await before.stop_generating()  # the run stops
            assert drawn == trained  # the latest fill's batch (the run saves it only while pending)
            accounted = [g.prompt_id for g in trained + buffer_state["ready"]] + state["in_flight"]
            assert sorted(accounted) == sorted(submitted[: state["submitted"]])

            resumed_buffer = Buffer(max_staleness=5)
            await resumed_buffer.load_state(buffer_state)
            resumed = sampler_for(manager, resumed_buffer, in_flight=False)
            del submitted[:]
            assert resumed.load_state(state) == len(state["in_flight"])
            await resumed.fill(2, policy_version=1, drain=True)
            assert submitted[: len(state["in_flight"])] == state["in_flight"]  # generated again, first
        finally:
            await client.close()

    asyncio.run(go())


async def pause_mid_sequence(client: EngineClient, timeout_s: float = 120.0) -> None:
    """Pauses the engine in place while its sequences run, and checks they are frozen
    mid-way. The CPU engine refuses /flush_cache while any sequence holds its KV; paused in
    place, a sequence that has finished has left, so a refusal then means one stands between
    two of its tokens (it was admitted, so it has at least one)."""

    async def running() -> bool:
        try:
            await client.flush_cache()
            return False
        except EngineRequestError:
            return True

    deadline = time.monotonic() + timeout_s
    while not await running():
        assert time.monotonic() < deadline, f"the engine ran no sequence within {timeout_s:.0f} s"
        await asyncio.sleep(0.005)
    await client.pause("in_place")
    assert await running(), "the sequence finished before the pause (a longer max_new_tokens)"


def test_a_sync_mid_sequence_reaches_r3_as_the_routing_each_token_was_made_with(routed_engine, tiny_hf_dir, tmp_path):
    """The sync is made to land mid-sequence: the engine is paused in place once the group's
    sequences are seen running, the new weights are synced (weight_sync.pause_mode = in_place,
    as R3 in flight needs) and generation continues. Each sample then carries both policy
    versions, and the batch R3 replays holds, for every position, the routing the engine
    recorded: the old weights' before the sync, the new weights' over the old KV after."""
    from safetensors.torch import load_file
    from test_engine_api import hf_continued, updated_model_dir

    from megatron_rlvr.weight_sync.syncer import WeightSyncer

    original = load_file(str(tiny_hf_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(13)
    new = {n: t + 0.5 * torch.randn(t.shape, generator=gen) for n, t in original.items() if ".layers." in n}
    prompt = [31, 4, 59, 26, 53, 58, 1, 93]

    async def go() -> Group:
        client = EngineClient(routed_engine.url)
        sampling = p.SamplingParams(max_new_tokens=480, n=2, temperature=1.0, ignore_eos=True)
        manager = RolloutManager([client], sampling, routing=RoutingShape(num_layers=2, top_k=2, num_experts=4))
        syncer = WeightSyncer(
            [client], WeightSyncConfig(bucket_mb=0.01, pause_mode="in_place"), initial_version=0, checksums=True
        )
        try:
            await syncer.connect()
            manager.submit(PromptItem("p", prompt, seed=7))
            await pause_mid_sequence(client)
            await syncer.sync(list(new.items()), 1)  # pauses (in place), loads, continues
            return await manager.next_group(timeout_s=300)
        finally:
            await syncer.close()
            await client.close()

    group = asyncio.run(go())
    for i, s in enumerate(group.samples):
        s.reward = float(i % 2)
    batch = groups_to_batch([group], advantage=advantage_options(AlgoConfig()), routing=(2, 2))
    assert batch.routed_experts is not None
    assert staleness_metrics(batch, policy_version=1)["staleness/mixed_version_share"] == 1.0
    updated = updated_model_dir(tiny_hf_dir, tmp_path, new)
    for row, s in enumerate(group.samples):
        spans = s.weight_versions
        assert [span["version"] for span in spans] == ["0", "1"], spans  # the sync landed mid-sequence
        switch, out = spans[1]["start"], s.response_ids
        assert 0 < switch < len(out)
        before = len(prompt) + switch - 1  # positions fed (and routed) by the old weights
        _, old_routing = hf_teacher_forced(tiny_hf_dir, prompt, out, 1.0)
        _, new_routing = hf_teacher_forced(updated, prompt, out, 1.0)
        _, continued = hf_continued(tiny_hf_dir, updated, prompt, out, switch, 1.0)
        replayed = batch.routed_experts[row, : len(prompt) + len(out) - 1].long()
        assert torch.equal(replayed[:before], old_routing[:before])  # what produced the early tokens
        assert torch.equal(replayed[before:], continued)  # the new weights over the old KV
        assert not torch.equal(replayed[:before], new_routing[:before])  # not the learner's routing now


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.updates=in_flight", "weight_sync.pause_mode=abort"], "weight_sync.pause_mode = abort"),
        (
            ["rollout.updates=in_flight", "algo.routing_replay=r3", "weight_sync.pause_mode=retract"],
            "weight_sync.pause_mode = retract: with rollout.updates = in_flight and algo.routing_replay = r3",
        ),
    ],
)
def test_in_flight_refuses_what_it_cannot_honour(overrides, expected):
    problems = _problems(overrides)
    assert any(expected in line for line in problems) and all("\n" not in line for line in problems), problems


def test_r3_in_flight_with_sglang_is_allowed_in_place_and_refused_retracted():
    """SGLang keeps a position's routing with its KV: after an in_place pause it returns the
    routing every token was produced with, after a retract the new weights' routing for the
    earlier tokens (tests/test_engine_api.py::test_routed_experts_of_a_sequence_a_sync_lands_in,
    docs/in-flight.md). In place (with the radix cache off, as SGLang's in_place needs) loads;
    retracted is refused in one line."""
    sglang = ["rollout.engine.type=sglang", "rollout.engine.device=cpu", "rollout.updates=in_flight"]
    r3 = [*sglang, "algo.routing_replay=r3"]
    cfg = load_config(
        TINY, [*r3, "weight_sync.pause_mode=in_place", "rollout.engine.extra_args=[--disable-radix-cache]"]
    )
    assert cfg.weight_sync.pause_mode == "in_place" and cfg.rollout.return_routed_experts is True
    problems = _problems([*r3, "weight_sync.pause_mode=retract"])
    assert problems == [
        "weight_sync.pause_mode = retract: with rollout.updates = in_flight and algo.routing_replay = r3 the "
        "pause must be in_place; a retracted sequence is routed again under the new weights, so the routing "
        "replayed for its earlier tokens would not be the one that produced them"
    ]
    assert load_config(TINY, [*sglang, "weight_sync.pause_mode=retract"]).algo.routing_replay == "none"


def test_staleness_metrics_need_counted_tokens():
    batch = groups_to_batch(
        [Group("p", "g", [sample(0, [5], [{"version": "0", "start": 0, "end": 1}], 1), sample(1, [5], [], 0)])],
        advantage=advantage_options(AlgoConfig()),
    )
    batch.response_mask = torch.zeros_like(batch.response_mask)
    assert staleness_metrics(batch, 1) == {}


@pytest.mark.parametrize("mode", ["local", pytest.param("ray", marks=pytest.mark.slow)])  # ray: ~2-3 min
def test_an_in_flight_r3_run_replays_the_routing_that_produced_every_token(mode, tmp_path):
    """End to end (CPU engine, in this process or as Ray actors): groups generate across the
    syncs, every token's staleness stays within the bound, and the learner's layers dispatch
    with exactly the routing the engine recorded, whichever weights produced it. Whether a
    sync lands mid-sequence here depends on the machine's timing; the test above makes one
    land there and checks what R3 is then given."""
    from test_train_e2e import train

    cores = sorted(os.sched_getaffinity(0))
    pinned = [f"launch.learner_cpus={cores[:1]}", f"launch.engine_cpus={cores[1:]}"] if mode == "ray" else []
    temp = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))  # Ray's Unix socket paths stay under 108 bytes
    try:
        metrics, _ = train(
            tmp_path,
            f"launch.mode={mode}",
            "algo.routing_replay=r3",
            "rollout.updates=in_flight",
            "weight_sync.pause_mode=in_place",
            "buffer.max_staleness=2",
            "rollout.max_new_tokens=96",
            *(pinned if len(cores) > 1 else []),  # the actors pin themselves
            env={"TMPDIR": str(temp)},
        )
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 0 <= m["staleness/min"] <= m["staleness/mean"] <= m["staleness/max"] <= 2
        assert "staleness/mixed_version_share" in m  # measured every step
        assert m["train/routing_agreement_engine_used"] == 1.0
        # a step whose batch was filled by groups that finished before it began generated nothing in it
        assert m["loop/tokens_per_s"] >= 0 and 0.0 <= m["loop/engine_busy_fraction"] <= 1.0
        assert m["buffer/used"] == 4 * m["step"]
    assert sum(m["loop/tokens_per_s"] for m in metrics) > 0 and any(m["loop/engine_busy_fraction"] for m in metrics)
