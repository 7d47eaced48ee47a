"""Adaptive group size: a size per step (constant, or linear from rollout.min_group_size to
max_group_size), one larger resample of a prompt whose group came back all equal, and a
fixed size that is today's fixed n exactly. Real CPU engine, manager and buffer."""

import asyncio
import random

import pytest
from engine_fixtures import start_engine

from megatron_rlvr.buffer.buffer import Buffer
from megatron_rlvr.config import ConfigError, load_config
from megatron_rlvr.data import PromptRecord
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.manager import RolloutManager
from megatron_rlvr.rollout.sampler import ActiveSampler, GroupSizes

PROMPTS = [PromptRecord(f"p{i}", str(i), str(i)) for i in range(12)]
TINY = "configs/tiny-moe-cpu.yaml"


@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory):
    server = start_engine(tiny_hf_dir, tmp_path_factory.mktemp("engine"), routed=False)
    yield server
    server.stop()


class RecordingManager(RolloutManager):
    """The real manager, also recording what each submission asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[str, int | None, int]] = []  # prompt, seed, samples

    def submit(self, item, n=None, **kwargs):
        self.asked.append((item.prompt_id, item.seed, n or self.sampling.n))
        return super().submit(item, n, **kwargs)


async def mixed(responses, record):
    """Every group of two or more samples has unequal rewards: every group is useful."""
    return [float(i % 2) for i in range(len(responses))]


async def equal_unless_large(responses, record):
    """All equal below 8 samples; at 8 and more, prompts p0-p5 differ (the rest stay equal)."""
    if len(responses) >= 8 and int(record.prompt_id[1:]) < 6:
        return [float(i % 2) for i in range(len(responses))]
    return [0.0] * len(responses)


def make_sampler(engine, sizes, score=mixed, n=4, **kwargs):
    client = EngineClient(engine.url)
    manager = RecordingManager([client], p.SamplingParams(max_new_tokens=2, n=n))
    sampler = ActiveSampler(
        manager,
        Buffer(),
        PROMPTS,
        encode=lambda record: [1, 5 + int(record.prompt)],
        decode=lambda ids: "",
        score=score,
        seed=3,
        group_sizes=sizes,
        **kwargs,
    )
    return sampler, client


def shape(batch):
    return [(g.prompt_id, [s.response_ids for s in g.samples]) for g in batch]


def test_the_schedule_gives_each_step_its_size():
    linear = GroupSizes(first=2, last=8, steps=4)
    assert [linear.at(step) for step in range(1, 7)] == [2, 4, 6, 8, 8, 8]
    assert [GroupSizes(first=4, last=16, steps=5).at(step) for step in range(1, 6)] == [4, 7, 10, 13, 16]
    assert {GroupSizes(first=6, last=6, steps=3).at(step) for step in range(1, 5)} == {6}
    assert GroupSizes(first=4, last=4, steps=1).at(1) == 4


def test_a_fixed_size_submits_the_groups_the_fixed_n_path_does(engine):
    async def go():
        fixed, fixed_client = make_sampler(engine, None)
        sized, sized_client = make_sampler(engine, GroupSizes(first=4, last=4, steps=3))
        for _ in range(3):
            a = await fixed.fill(2, 0, drain=True)
            b = await sized.fill(2, 0, drain=True)
            assert shape(a) == shape(b)
        assert fixed.manager.asked == sized.manager.asked  # same prompts, same seeds, same sizes
        # and those of the fixed-n derivation: a shuffled pass over the prompts, seed · 1000003 + submission
        order = list(PROMPTS)
        random.Random(3).shuffle(order)
        expected = [(r.prompt_id, 3 * 1_000_003 + k, 4) for k, r in enumerate(reversed(order))]
        assert sized.manager.asked == expected[: len(sized.manager.asked)]
        assert sized.step_stats()["rollout/group_size"] == 4
        await fixed_client.close()
        await sized_client.close()

    asyncio.run(go())


def test_a_linear_schedule_sizes_each_step_and_continues_after_a_resume(engine):
    sizes = GroupSizes(first=2, last=8, steps=4)
    bound = {"max_groups": 2}  # every group is useful: each step generates its own batch, no surplus

    async def go():
        whole, whole_client = make_sampler(engine, sizes, **bound)
        scheduled, batches = [], []
        for version in range(4):
            batch = await whole.fill(2, 0, drain=True)
            assert [len(g.samples) for g in batch] == [sizes.at(version + 1)] * 2
            batches.append(shape(batch))
            stats = whole.step_stats()
            scheduled.append(stats["rollout/group_size"])
            asked = {n for _, _, n in whole.manager.asked[-stats["sampler/groups_generated"] :]}
            assert asked == {sizes.at(version + 1)}  # every group this step submitted
        assert scheduled == [2, 4, 6, 8]

        first, first_client = make_sampler(engine, sizes, **bound)
        for _ in range(2):
            await first.fill(2, 0, drain=True)
        sampler_state, buffer_state, _ = await first.snapshot()
        resumed, resumed_client = make_sampler(engine, sizes, **bound)
        resumed.load_state(sampler_state)
        await resumed.buffer.load_state(buffer_state)
        for version in (2, 3):
            assert shape(await resumed.fill(2, 0, drain=True)) == batches[version]
            assert resumed.step_stats()["rollout/group_size"] == scheduled[version]
        for client in (whole_client, first_client, resumed_client):
            await client.close()

    asyncio.run(go())


def test_a_group_with_equal_rewards_is_sampled_once_more_larger(engine):
    async def go():
        sampler, client = make_sampler(engine, GroupSizes(first=2, last=2, resample=8), score=equal_unless_large)
        batch = await sampler.fill(3, 0, drain=True)
        stats, buffer = sampler.step_stats(), await sampler.buffer.stats()
        assert [len(g.samples) for g in batch] == [8, 8, 8] and {g.prompt_id for g in batch} <= {
            f"p{i}" for i in range(6)
        }
        asked = sampler.manager.asked
        scheduled = [a for a in asked if a[2] == 2]
        resamples = [a for a in asked if a[2] == 8]
        # every scheduled group came back equal and was resampled; each resample is counted,
        # those on p0-p5 were useful; the rest dropped too (all generated groups are accounted)
        assert stats["sampler/resampled_on_equal"] == len(resamples) == len(scheduled)
        assert [r[0] for r in resamples] == [s[0] for s in scheduled]
        assert stats["sampler/resampled_useful"] == sum(int(r[0][1:]) < 6 for r in resamples) >= 3
        assert buffer["dropped_zero_std"] == len(scheduled) + len(resamples) - stats["sampler/resampled_useful"]
        assert stats["rollout/group_size"] == 2  # the schedule's size; resamples are counted apart
        # a resample's seeds (seed .. seed + 7) meet no scheduled group's (seed + submission + index)
        scheduled_seeds = {s[1] + i for s in scheduled for i in range(2)}
        resample_seeds = {r[1] + i for r in resamples for i in range(8)}
        assert len(resample_seeds) == 8 * len(resamples) and not scheduled_seeds & resample_seeds
        await client.close()

    asyncio.run(go())


def test_resamples_stay_within_the_fill_bound(engine):
    async def go():
        sampler, client = make_sampler(
            engine, GroupSizes(first=2, last=2, resample=4), score=equal_unless_large, max_groups=6, min_groups=0
        )
        batch = await sampler.fill(2, 0, drain=True)  # nothing is useful at 4 samples: a bound spent
        assert batch == []
        sizes = [n for _, _, n in sampler.manager.asked]
        assert len(sizes) == 6 and sizes[:4] == [2, 2, 2, 2] and 4 in sizes  # resamples, within the bound
        assert sampler.step_stats()["sampler/resampled_on_equal"] == sizes.count(4)
        assert (await sampler.buffer.stats())["dropped_zero_std"] == 6  # every group filed, none lost
        await client.close()

    asyncio.run(go())


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["rollout.group_size_schedule=linear", "rollout.min_group_size=8", "rollout.max_group_size=4"],
            "rollout.min_group_size = 8: must be <= rollout.max_group_size (4)",
        ),
        (
            ["rollout.min_group_size=4", "rollout.max_group_size=8"],
            "rollout.n_samples_per_prompt = 16: the constant schedule's size must lie",
        ),
        (["rollout.extra_samples_on_equal=true"], "rollout.extra_samples_on_equal = true: a resample has"),
        (["rollout.min_group_size=1"], "rollout.min_group_size = 1"),
    ],
)
def test_group_size_settings_that_contradict_each_other_are_refused(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert any(expected in line for line in err.value.problems), err.value.problems


def test_sizes_that_vary_lift_the_exact_split_check_sizes_that_do_not_keep_it():
    uneven = ["buffer.batch_groups=3", "rollout.n_samples_per_prompt=3", "algo.num_minibatches=2"]
    with pytest.raises(ConfigError, match="algo.num_minibatches = 2"):
        load_config(TINY, uneven)
    cfg = load_config(TINY, [*uneven, "rollout.group_size_schedule=linear", "rollout.max_group_size=6"])
    assert (cfg.rollout.min_group_size, cfg.rollout.max_group_size) == (3, 6)
    assert GroupSizes.of(cfg.rollout, 5) == GroupSizes(first=3, last=6, steps=5)
    cfg = load_config(TINY, ["rollout.extra_samples_on_equal=true", "rollout.max_group_size=32"])
    assert GroupSizes.of(cfg.rollout, 2) == GroupSizes(first=16, last=16, steps=2, resample=32)


def test_a_linear_schedule_runs_through_the_loop_and_continues_after_a_resume(tmp_path):
    from test_train_e2e import train

    # resamples mix sizes within a batch, and 3 mini-batches split no total exactly: padding rows
    linear = (
        "launch.mode=local",
        "rollout.group_size_schedule=linear",
        "rollout.min_group_size=4",
        "rollout.extra_samples_on_equal=true",
        "algo.num_minibatches=3",
    )
    train(tmp_path, *linear, "trainer.steps=2", "rollout.max_group_size=6")
    # the longer run's schedule (4 → 10 over 4 steps) continues at step 3, not at its step 1
    metrics, done = train(tmp_path, *linear, "trainer.steps=4", "rollout.max_group_size=10", "trainer.resume=true")
    assert "resumed from" in done.stderr
    schedule, resample = {1: 4, 2: 6, 3: 8, 4: 10}, {1: 6, 2: 6, 3: 10, 4: 10}
    # a step trained from the buffer's surplus alone generated nothing and logs no size
    sizes = {m["step"]: m.get("rollout/group_size") for m in metrics if m["sampler/groups_generated"]}
    assert sizes == {step: schedule[step] for step in sizes} and max(sizes) > 2
    for m in metrics:  # every sample scored in a step belongs to a group of the step's size, or a resample
        step, resampled = m["step"], m["sampler/resampled_on_equal"]
        scheduled = m["sampler/groups_generated"] - resampled
        assert m["reward/samples"] == scheduled * schedule[step] + resampled * resample[step]
        assert m["sampler/resampled_useful"] <= resampled and m["train/grad_norm"] > 0
    assert sum(m["sampler/resampled_on_equal"] for m in metrics) > 0
    assert [m["buffer/used"] for m in metrics] == [4, 8, 12, 16]
