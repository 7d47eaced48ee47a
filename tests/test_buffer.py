"""The buffer: zero-gradient filter, exact batches, staleness, and the groups peers crash on."""

import asyncio

import pytest

from megatron_rlvr.buffer.buffer import Buffer, group_version
from megatron_rlvr.samples import Group, Sample


def make_group(rewards, *, version="0", prompt="p", finish="length", error=None, spans=None):
    samples = [
        Sample(
            prompt_id=prompt,
            group_id=f"{prompt}-g",
            index=i,
            prompt_ids=[1],
            response_ids=[2],
            rollout_logprobs=[-1.0],
            finish_reason=finish,
            weight_version=version,
            weight_versions=spans or [{"version": version, "start": 0, "end": 1}],
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]
    return Group(prompt, f"{prompt}-g", samples, error=error, aborted=finish == "abort")


def run(coro):
    return asyncio.run(coro)


def test_filters_zero_gradient_and_broken_groups_with_a_count_for_each():
    async def go():
        buffer = Buffer()
        verdicts = [
            await buffer.put(g)
            for g in [
                make_group([1, 0, 1, 0]),  # useful
                make_group([1, 1, 1, 1]),  # all correct: no gradient
                make_group([0.0, 0.0]),  # all wrong
                make_group([1e-9, 0.0, 0.0]),  # equal within eps
                Group("p", "g", [], error="engine refused the prompt"),  # every sample failed
                make_group([1, 0], finish="abort"),  # partial responses
                make_group([None, 1.0]),  # a verifier result missing
                make_group([1.0]),  # a group of one
            ]
        ]
        assert verdicts == ["kept", "zero_std", "zero_std", "zero_std", "failed", "aborted", "unscored", "too_small"]
        stats = await buffer.stats()
        assert stats["generated"] == 8 and stats["kept"] == 1 and stats["dropped_zero_std"] == 3
        assert (
            stats["dropped_failed"]
            == stats["dropped_aborted"]
            == stats["dropped_unscored"]
            == stats["dropped_too_small"]
            == 1
        )

    run(go())


def test_fan_out_and_partial_groups_are_kept_when_useful():
    async def go():
        buffer = Buffer()
        assert await buffer.put(make_group([1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1])) == "kept"  # bigger than n
        assert await buffer.put(make_group([1, 0, 1])) == "kept"  # some samples missing
        assert len(await buffer.get_batch(2, policy_version=0)) == 2

    run(go())


def test_get_batch_returns_exactly_n_and_keeps_the_rest_for_later():
    async def go():
        buffer = Buffer()
        for i in range(5):
            await buffer.put(make_group([1, 0], prompt=f"p{i}"))
        first = await buffer.get_batch(3, policy_version=0)
        assert [g.prompt_id for g in first] == ["p0", "p1", "p2"]  # oldest first
        assert (await buffer.stats())["waiting"] == 2
        second = await buffer.get_batch(2, policy_version=1)  # one version later: still fresh
        assert [g.prompt_id for g in second] == ["p3", "p4"] and (await buffer.stats())["drawn"] == 5

    run(go())


def test_get_batch_waits_for_enough_useful_groups():
    async def go():
        buffer = Buffer()
        waiter = asyncio.create_task(buffer.get_batch(2, policy_version=0))
        await buffer.put(make_group([1, 0], prompt="a"))
        await buffer.put(make_group([1, 1], prompt="useless"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await buffer.put(make_group([0, 1], prompt="b"))
        assert [g.prompt_id for g in await asyncio.wait_for(waiter, 2)] == ["a", "b"]
        with pytest.raises(asyncio.TimeoutError):
            await buffer.get_batch(1, policy_version=0, timeout_s=0.05)

    run(go())


def test_groups_older_than_the_staleness_bound_are_dropped_and_counted():
    async def go():
        buffer = Buffer(max_staleness=1)
        await buffer.put(make_group([1, 0], version="3", prompt="old"))
        await buffer.put(make_group([1, 0], version="4", prompt="new"))
        # a group whose tokens span two versions counts as its oldest
        await buffer.put(
            make_group(
                [1, 0],
                prompt="mixed",
                spans=[{"version": "3", "start": 0, "end": 5}, {"version": "5", "start": 5, "end": 9}],
            )
        )
        batch = await buffer.get_batch(1, policy_version=5)
        assert [g.prompt_id for g in batch] == ["new"] and (await buffer.stats())["dropped_stale"] == 2

    run(go())


def test_group_version_reads_spans():
    assert group_version(make_group([1, 0], version="7")) == 7
