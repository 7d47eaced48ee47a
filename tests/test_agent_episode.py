"""Episodes on the CPU engine (loopback HTTP) with the scripted tiny model (agent_scripted.py):
token in / token out, masks, budgets, prefix breaks, and tools that are slow or crash."""

import asyncio
import threading

import pytest
from agent_scripted import CALL, build_scripted_model
from engine_fixtures import start_engine
from transformers import AutoTokenizer

from megatron_rlvr.agent.episode import Episode, EpisodeSettings
from megatron_rlvr.agent.parsers import parse_hermes
from megatron_rlvr.agent.render import TemplateBreaksPrefix, TurnRenderer, check_template
from megatron_rlvr.agent.tools import FunctionTool, ToolInfraError, ToolPool, calculator
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.routed_experts import decode_routed_experts

QUESTION = [{"role": "user", "content": "What is 12*34?"}]
SAMPLING = p.SamplingParams(max_new_tokens=100, temperature=1.0, sampling_seed=7)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model_dir = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    engine = start_engine(model_dir, tmp_path_factory.mktemp("engine"))
    yield model_dir, engine
    engine.stop()


def _episode(model_dir, client, tools, *, max_turns=3, thinking=False, routed=True, **pool_args):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool = ToolPool(tools, **pool_args)
    renderer = TurnRenderer(tokenizer, tools=pool.schemas(), template_kwargs={"enable_thinking": thinking})

    async def generate(request):
        return (await client.generate(request))[0]

    def routing(meta, label):
        return decode_routed_experts(meta.routed_experts, num_layers=2, top_k=2, num_experts=4, sample=label)

    return Episode(
        renderer=renderer,
        parser=parse_hermes,
        pool=pool,
        settings=EpisodeSettings(max_turns=max_turns),
        tokenizer=tokenizer,
        generate=generate,
        decode_routing=routing if routed else None,
    ), tokenizer


def test_a_three_turn_episode_is_token_in_token_out(scripted):
    model_dir, engine = scripted
    calls = []

    def calc(expression: str) -> str:
        """Evaluates arithmetic."""
        calls.append(expression)
        return calculator(expression)

    async def run():
        client = EngineClient(engine.url)
        episode, tokenizer = _episode(model_dir, client, {"calculator": FunctionTool(calc, name="calculator")})
        sample = await episode.run(QUESTION, SAMPLING, rid="ep", index=0)
        await client.close()
        return episode, tokenizer, sample

    episode, tokenizer, sample = asyncio.run(run())
    turns = episode.turns
    assert len(turns) == 3 and calls == ["12*34", "12*34"]  # the third turn's call is past max_turns
    assert sample.episode.turns == 3 and sample.episode.tool_calls == 2 and sample.episode.tool_errors == 0
    assert sample.episode.ended == "max_turns" and sample.finish_reason == "stop"
    # each turn's input is the previous input + the model's tokens + the rendered tool turn
    for before, after in zip(turns, turns[1:]):
        assert after.input_ids[: len(before.input_ids) + len(before.output_ids)] == before.input_ids + before.output_ids
    full = sample.prompt_ids + sample.response_ids
    assert full[: len(turns[-1].input_ids)] == turns[-1].input_ids and full[len(turns[-1].input_ids) :] == (
        turns[-1].output_ids
    )
    # the ids are the template's own rendering of the conversation (no drift), tool turn included
    tool_turn = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(full[len(turns[0].input_ids) + len(turns[0].output_ids) : len(turns[1].input_ids)]) == (
        tool_turn
    )
    # and the template's rendering of the whole conversation so far is exactly the last input
    said = sample.episode.final_text
    conversation = QUESTION + [{"role": "assistant", "content": said}, {"role": "tool", "content": "408"}] * 2
    assert episode.renderer.render(conversation, generation_prompt=True) == turns[-1].input_ids
    # mask 1 exactly on sampled tokens; tool and boundary tokens are not the response's length
    sampled = [i for t in turns for i in t.output_ids]
    assert [tok for tok, m in zip(sample.response_ids, sample.loss_mask) if m] == sampled
    assert sample.sampled_tokens() == len(sampled) == 3 * 4 < len(sample.response_ids)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask) if not m)
    assert all(lp > -1e-3 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask) if m)  # the scripted token
    assert tokenizer.decode(turns[0].output_ids) == f"<tool_call>{CALL}</tool_call><|im_end|>"
    # routing of every position but the last; versions span the model's tokens
    assert sample.routed_experts.shape == (len(full) - 1, 2, 2)
    assert sample.token_versions() == [0] * len(sample.response_ids)
    starts = [s["start"] for s in sample.weight_versions]
    assert starts == [
        0,
        len(turns[1].input_ids) - len(sample.prompt_ids),
        len(turns[2].input_ids) - len(sample.prompt_ids),
    ]


def test_a_cut_last_turn_or_a_tool_turn_over_the_budget_is_a_length_finish(scripted):
    model_dir, engine = scripted

    async def run(budget):
        client = EngineClient(engine.url)
        episode, tokenizer = _episode(model_dir, client, {"calculator": FunctionTool(calculator)})
        sample = await episode.run(QUESTION, SAMPLING.model_copy(update={"max_new_tokens": budget}), index=0)
        await client.close()
        return episode, tokenizer, sample

    episode, tokenizer, sample = asyncio.run(run(30))  # 4 sampled tokens, then a tool turn over the budget
    assert sample.finish_reason == "length" and sample.episode.ended == "length"
    assert sample.response_ids == episode.turns[0].output_ids and episode.turns[0].finish_reason == "stop"
    tool_turn = len(episode.turns[1].input_ids) if len(episode.turns) > 1 else None
    assert tool_turn is None
    # room for the tool turn and 2 of the second turn's 4 tokens: the engine cuts that turn
    bridge = episode.renderer.bridge(QUESTION, sample.episode.final_text, [{"role": "tool", "content": "408"}], [2])
    episode, _, sample = asyncio.run(run(4 + len(bridge.ids) + 2))
    assert [t.finish_reason for t in episode.turns] == ["stop", "length"]
    assert sample.finish_reason == "length" and sample.episode.ended == "length" and sample.sampled_tokens() == 6


def test_a_template_that_strips_past_thinking_is_refused_and_counted(scripted):
    model_dir, engine = scripted
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(TemplateBreaksPrefix, match="rewrites past turns"):
        check_template(TurnRenderer(tokenizer))

    async def run():
        client = EngineClient(engine.url)
        episode, _ = _episode(model_dir, client, {"calculator": FunctionTool(calculator)}, thinking=True)
        sample = await episode.run(QUESTION, SAMPLING, index=0)
        await client.close()
        return sample

    sample = asyncio.run(run())
    assert sample.episode.prefix_breaks == 1 and sample.episode.ended == "prefix_break"
    assert sample.episode.turns == 1 and sample.loss_mask == [1] * len(sample.response_ids)


def test_a_slow_tool_holds_back_no_other_episode(scripted):
    model_dir, engine = scripted
    started, release = threading.Event(), threading.Event()

    def slow(expression: str) -> str:
        """Answers once released."""
        started.set()
        release.wait(60)
        return "408"

    async def run():
        client = EngineClient(engine.url)
        slow_episode, _ = _episode(
            model_dir, client, {"calculator": FunctionTool(slow, name="calculator")}, max_turns=2
        )
        fast_episode, _ = _episode(model_dir, client, {"calculator": FunctionTool(calculator)}, max_turns=3)
        slow_task = asyncio.create_task(slow_episode.run(QUESTION, SAMPLING, index=0))
        assert await asyncio.to_thread(started.wait, 60)  # the slow call runs
        fast = await fast_episode.run(QUESTION, SAMPLING, index=1)
        still_running = not slow_task.done()
        release.set()
        slowed = await asyncio.wait_for(slow_task, 60)
        await client.close()
        return still_running, fast, slowed

    still_running, fast, slowed = asyncio.run(run())
    assert still_running and fast.episode.turns == 3  # three turns and two tools while the slow call ran
    assert slowed.episode.turns == 2 and slowed.episode.tool_errors == 0


def test_a_tool_past_its_deadline_or_crashing_is_an_error_the_model_sees(scripted):
    model_dir, engine = scripted
    release = threading.Event()

    def hang(expression: str) -> str:
        """Never answers in time."""
        release.wait(60)
        return "late"

    def crash(expression: str) -> str:
        """Raises."""
        raise RuntimeError("the tool broke")

    async def run():
        client = EngineClient(engine.url)
        late, tokenizer = _episode(
            model_dir, client, {"calculator": FunctionTool(hang, name="calculator")}, max_turns=2, timeout_s=0.5
        )
        broken, _ = _episode(model_dir, client, {"calculator": FunctionTool(crash, name="calculator")}, max_turns=2)
        samples = await asyncio.gather(late.run(QUESTION, SAMPLING, index=0), broken.run(QUESTION, SAMPLING, index=1))
        release.set()
        await client.close()
        return tokenizer, samples

    tokenizer, (timed_out, crashed) = asyncio.run(run())
    assert timed_out.episode.tool_errors == 1 and timed_out.episode.turns == 2
    assert "<tool_response>\nerror: calculator timed out after 0.5 s\n</tool_response>" in tokenizer.decode(
        timed_out.response_ids
    )
    assert crashed.episode.tool_errors == 1 and crashed.episode.turns == 2
    assert "error: calculator failed: RuntimeError: the tool broke" in tokenizer.decode(crashed.response_ids)


def test_a_stuck_pool_is_an_infrastructure_failure(scripted):
    model_dir, engine = scripted
    release = threading.Event()

    def hang(expression: str) -> str:
        """Holds its worker."""
        release.wait(30)
        return "late"

    async def run():
        client = EngineClient(engine.url)
        episode, _ = _episode(
            model_dir,
            client,
            {"calculator": FunctionTool(hang, name="calculator")},
            workers=1,
            timeout_s=0.5,
            acquire_timeout_s=1.0,
        )
        try:
            with pytest.raises(ToolInfraError, match="no tool worker came free"):
                await episode.run(QUESTION, SAMPLING, index=0)
        finally:
            release.set()
            await client.close()

    asyncio.run(run())
