"""Active sampling with a bound: a step never generates more than its budget, trains on the
useful groups it found (a short batch whose padding changes nothing), ends the run when a
bound passes without them, and skips prompts that keep giving zero-std groups (GRESO)."""

import asyncio
from collections import Counter

import pytest
import torch
from distributed import run_ranks
from engine_fixtures import start_engine

from megatron_rlvr.batching import spread_over_slots
from megatron_rlvr.buffer.buffer import Buffer
from megatron_rlvr.data import PromptRecord
from megatron_rlvr.learner.batch import TrainBatch, micro_batches, minibatch_indices
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.manager import RolloutManager
from megatron_rlvr.rollout.prompt_history import PromptHistory
from megatron_rlvr.rollout.sampler import ActiveSampler, NothingToLearn

PROMPTS = [PromptRecord(f"p{i}", str(i), str(i)) for i in range(12)]
USEFUL = {"p3", "p7"}  # the only prompts whose groups have reward variance


def verdicts_by_prompt(useful=USEFUL, solved=frozenset({"p0", "p1", "p2", "p4"})):
    """A scorer standing in for a policy that is polarised on most prompts: all right on
    `solved`, all wrong on the rest, mixed only on `useful` (the prompt text is its id)."""

    async def score(responses, record):
        prompt = record.prompt_id
        if prompt in useful:
            return [float(i % 2) for i in range(len(responses))]
        return [1.0 if prompt in solved else 0.0] * len(responses)

    return score


@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory):
    server = start_engine(tiny_hf_dir, tmp_path_factory.mktemp("engine"), routed=False)
    yield server
    server.stop()


class CountingBuffer(Buffer):
    """The real buffer, also counting the groups filed per prompt."""

    def __init__(self):
        super().__init__()
        self.filed = Counter()

    async def put(self, group):
        self.filed[group.prompt_id] += 1
        return await super().put(group)


def make_sampler(engine, **kwargs):
    client = EngineClient(engine.url)
    manager = RolloutManager([client], p.SamplingParams(max_new_tokens=2, n=4))
    sampler = ActiveSampler(
        manager,
        CountingBuffer(),
        PROMPTS,
        encode=lambda record: [1, 5 + int(record.prompt)],
        decode=lambda ids: "",
        score=verdicts_by_prompt(),
        seed=0,
        **kwargs,
    )
    return sampler, client


def test_a_step_never_generates_more_than_its_bound_and_trains_on_what_it_found(engine):
    async def go():
        sampler, client = make_sampler(engine, max_groups=12)
        # 12 groups (one pass over the prompts) hold exactly 2 useful ones: a short batch of 2
        batch = await sampler.fill(4, policy_version=0, drain=True)
        assert sorted(g.prompt_id for g in batch) == sorted(USEFUL)
        stats = sampler.step_stats()
        assert stats["sampler/groups_generated"] == 12 and stats["buffer/short_batches"] == 1
        assert stats["sampler/always_solved"] == 4 and stats["sampler/never_solved"] == 6
        await client.close()

    asyncio.run(go())


def test_a_bound_spent_without_a_useful_group_ends_with_what_the_prompts_say(engine):
    async def go():
        sampler, client = make_sampler(engine, max_groups=20)
        sampler.score = verdicts_by_prompt(useful=set())
        with pytest.raises(NothingToLearn) as err:
            await sampler.fill(4, policy_version=0, drain=True)
        assert sampler.step_stats()["sampler/groups_generated"] == 20
        message = str(err.value)
        assert "no useful group among 20 generated" in message
        assert "4 were always solved and 8 never solved" in message
        await client.close()

    asyncio.run(go())


def test_fewer_useful_groups_than_a_batch_can_hold_also_end_the_run(engine):
    async def go():
        sampler, client = make_sampler(engine, max_groups=12, min_groups=3)
        with pytest.raises(NothingToLearn, match=r"only 2 useful groups \(a batch needs 3\)"):
            await sampler.fill(4, policy_version=0, drain=True)
        await client.close()

    asyncio.run(go())


def test_prompts_that_keep_giving_zero_std_groups_are_skipped_but_probed_again(engine):
    async def go():
        history = PromptHistory(
            enabled=True, explore_solved=0.5, explore_unsolved=0.5, max_skip_probability=0.75, seed=0
        )
        sampler, client = make_sampler(engine, history=history, max_groups=12)
        skipped = 0
        for _ in range(20):
            await sampler.fill(2, policy_version=0, drain=True)  # the engine stays at version 0
            skipped += sampler.step_stats()["sampler/skipped_prompts"]
        # the useful prompts are never skipped; the polarised ones come back less often, but come back
        filed = sampler.buffer.filed
        useful = [filed[pid] for pid in USEFUL]
        polarised = [filed[f"p{i}"] for i in range(12) if f"p{i}" not in USEFUL]
        print("filed per prompt:", dict(filed), "skipped:", skipped)
        assert skipped > 0 and min(useful) >= 20
        assert sum(polarised) / len(polarised) < 0.5 * min(useful) and min(polarised) >= 2
        state = sampler.state()
        restored, _ = make_sampler(
            engine,
            history=PromptHistory(
                enabled=True, explore_solved=0.5, explore_unsolved=0.5, max_skip_probability=0.75, seed=0
            ),
        )
        restored.load_state(state)
        assert restored.history.outcomes == sampler.history.outcomes  # checkpointed with the sampler
        await client.close()

    asyncio.run(go())


def test_skip_probability_grows_with_the_streak_and_stays_below_one():
    history = PromptHistory(enabled=True, explore_solved=0.5, explore_unsolved=0.8, max_skip_probability=0.9, seed=0)
    for streak in range(1, 8):
        history.record("easy", [1.0, 1.0], zero_std=True)
        history.record("hard", [0.0, 0.0], zero_std=True)
        assert history.skip_probability("easy") == pytest.approx(min(0.9, 1 - 0.5**streak))
        assert history.skip_probability("hard") == pytest.approx(min(0.9, 1 - 0.8**streak))
    history.record("easy", [1.0, 0.0], zero_std=False)  # a useful group resets the streak
    history.record("hard", [1.0, 1.0], zero_std=True)  # solved now: a streak of another kind
    assert history.skip_probability("easy") == 0.0
    assert history.skip_probability("hard") == pytest.approx(0.5)
    assert history.counts() == {"always_solved": 1, "never_solved": 0}
    off = PromptHistory(enabled=False, explore_solved=0.5, explore_unsolved=0.5, max_skip_probability=0.9, seed=0)
    off.record("easy", [1.0, 1.0], zero_std=True)
    assert off.skip_probability("easy") == 0.0 and off.counts()["always_solved"] == 1


@pytest.mark.parametrize("rows, slots, micro", [(12, 4, 8), (10, 4, 2), (5, 1, 2), (3, 2, 8), (16, 2, 8)])
def test_a_short_batch_is_laid_out_so_every_slot_splits_and_holds_real_rows(rows, slots, micro):
    batch = TrainBatch(
        torch.arange(rows)[:, None].repeat(1, 3),
        torch.ones(rows, 3),
        advantages=torch.arange(rows, dtype=torch.float32),
    )
    laid_out = spread_over_slots(batch, slots, micro)
    num_minibatches, dp = slots, 1
    real_rows = []
    for index in minibatch_indices(laid_out.size, num_minibatches, dp, 0):
        part = laid_out.select(index)
        micro_batches(laid_out, index, micro)  # splits into whole micro-batches
        real = part.response_mask.sum(-1) > 0
        assert real.any()  # every mini-batch trains on something
        real_rows += part.input_ids[real, 0].tolist()
    assert sorted(real_rows) == list(range(rows))  # every sample exactly once, unmasked
    if rows % slots == 0 and (rows // slots <= micro or rows // slots % micro == 0):
        assert laid_out is batch  # a batch that fits is not touched


def test_padding_rows_of_a_short_batch_change_neither_loss_nor_gradient(tiny_hf_dir, tmp_path):
    result = run_ranks(1, ["short-batch", str(tiny_hf_dir), "algo.num_minibatches=1", "trainer.lr=1e-30"], tmp_path)[0]
    assert result["rows"] == 6 and result["padding_masked"] == 0.0
    padded, plain = result["with_padding"], result["plain"]
    for key in ("policy_loss", "grad_norm", "entropy", "clipfrac", "approx_kl"):
        assert padded[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
