"""Episodes through the rollout: the manager runs a group as n episodes on the CPU engine, the
sampler scores each episode's final turn and files the group, and a tool machinery that dies
fails the group, counted."""

import asyncio
import itertools
import threading

import pytest
from agent_scripted import CALL, KEEP_TEMPLATE, build_scripted_model
from engine_fixtures import start_engine
from transformers import AutoTokenizer

from megatron_rlvr.agent.runner import AgentRunner
from megatron_rlvr.agent.tools import FunctionTool, ToolInfraError, ToolResult
from megatron_rlvr.buffer.buffer import Buffer
from megatron_rlvr.config import Config
from megatron_rlvr.config.agent import AgentConfig
from megatron_rlvr.data import PromptRecord
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.manager import PromptItem, RolloutManager, RoutingShape
from megatron_rlvr.rollout.sampler import ActiveSampler

QUESTION = [{"role": "user", "content": "What is 12*34?"}]
SAMPLING = p.SamplingParams(max_new_tokens=100, n=3)
_draws = itertools.count()


def _lucky(expression: str) -> ToolResult:
    """Evaluates arithmetic and grants a reward that differs from call to call."""
    return ToolResult("408", reward=0.25 * (next(_draws) % 3))


def _dead_sandbox(expression: str) -> str:
    """A tool whose machinery is gone."""
    raise ToolInfraError("the sandbox could not start")


# the scripted model calls `calculator`: tools registered by `module:attribute` under that name
lucky = FunctionTool(_lucky, name="calculator")
dead_sandbox = FunctionTool(_dead_sandbox, name="calculator")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model_dir = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    engine = start_engine(model_dir, tmp_path_factory.mktemp("engine"))
    yield model_dir, engine
    engine.stop()


def _manager(model_dir, engine, **agent):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = AgentRunner(AgentConfig(**agent), tokenizer, model_type="qwen3_moe", chat_template=KEEP_TEMPLATE)
    client = EngineClient(engine.url)
    return RolloutManager([client], SAMPLING, routing=RoutingShape(2, 2, 4), agent=runner), client, tokenizer


def test_a_group_is_n_episodes_scored_on_their_final_turns(scripted):
    model_dir, engine = scripted
    record = PromptRecord("q", QUESTION, "408")
    seen = []

    async def score(responses, rec):
        seen.extend(responses)
        return [1.0] * len(responses)

    async def run():
        manager, client, tokenizer = _manager(
            model_dir, engine, tools=[f"{__name__}:lucky"], max_turns=2, reward_aggregator="sum"
        )
        sampler = ActiveSampler(
            manager,
            Buffer(),
            [record],
            encode=lambda r: [1],
            decode=tokenizer.decode,
            score=score,
            messages=lambda r: list(r.prompt),
            max_groups=2,
        )
        batch = await sampler.fill(1, policy_version=0, drain=True)
        stats, (rewards, tokens) = sampler.step_stats(), sampler.take_rewards()
        await client.close()
        return batch, stats, rewards, tokens, manager

    batch, stats, rewards, tokens, manager = asyncio.run(run())
    [group] = batch
    assert len(group.samples) == 3 and {s.index for s in group.samples} == {0, 1, 2}
    for sample in group.samples:
        assert sample.episode.turns == 2 and sample.episode.tool_calls == 1 and sample.episode.ended == "max_turns"
        assert sample.routed_experts.shape == (len(sample.prompt_ids) + len(sample.response_ids) - 1, 2, 2)
        assert sample.reward == 1.0 + sum(sample.episode.tool_rewards)  # sum: verdict + the tool's reward
    # the verifier saw each episode's final model turn, not the whole response
    assert set(seen) == {f"<tool_call>{CALL}</tool_call>"} and len(seen) % 3 == 0
    assert set(s.reward for s in group.samples) <= set(rewards) and len({s.reward for s in group.samples}) > 1
    assert tokens == len(rewards) * 8  # sampled tokens only: two turns of four, tool turns not counted
    assert (
        stats["agent/turns_mean"] == 2 and stats["agent/tool_calls"] == len(rewards) and stats["agent/tool_errors"] == 0
    )
    assert stats["agent/prefix_breaks"] == 0 and stats["agent/truncated"] == 0
    assert manager.stats["failed"] == 0


def test_a_dying_tool_machinery_fails_the_group_counted(scripted):
    model_dir, engine = scripted

    async def run():
        manager, client, _ = _manager(model_dir, engine, tools=[f"{__name__}:dead_sandbox"], max_episode_attempts=2)
        manager.submit(PromptItem("q", [1], messages=QUESTION))
        group = await manager.next_group(120)
        await client.close()
        return group, manager

    group, manager = asyncio.run(run())
    assert not group.samples and "the tools failed 2 times: the sandbox could not start" in group.error
    assert manager.stats["tool_failed"] == 1 and manager.stats["failed"] == 1 and manager.stats["tool_retried"] >= 1


def test_the_agent_section_is_checked():
    assert Config().agent is None  # no section: single-turn rollouts
    assert Config(agent={"tools": ["calculator", "python"], "max_turns": 4}).agent.max_turns == 4
    with pytest.raises(ValueError, match="agent.tools is empty"):
        AgentConfig(tools=[])
    with pytest.raises(ValueError, match="tool_call_format"):
        AgentConfig(tool_call_format="xml")


def test_evaluation_runs_episodes_and_scores_their_final_turns(scripted):
    import numpy as np

    from megatron_rlvr.config import load_config
    from megatron_rlvr.data.chat import EncodedPrompts
    from megatron_rlvr.evaluation import EvalSet, Evaluator

    model_dir, engine = scripted
    cfg = load_config(None, ["eval.n_samples=2", "eval.max_new_tokens=100"])
    records = [PromptRecord(f"q{i}", QUESTION, "408") for i in range(2)]
    prompts = EncodedPrompts(records, {r.prompt_id: np.asarray([1], dtype=np.int32) for r in records})
    seen = []

    async def score(responses, record, count=False):
        seen.extend(responses)
        return [1.0 if "12*34" in r else 0.0 for r in responses]

    async def run():
        manager, client, tokenizer = _manager(model_dir, engine, max_turns=2)
        evaluator = Evaluator(
            cfg, [EvalSet("held", prompts)], manager, score, tokenizer.decode, None, messages=lambda r: list(r.prompt)
        )
        metrics = await evaluator.evaluate()
        await client.close()
        return metrics

    metrics = asyncio.run(run())
    assert set(seen) == {f"<tool_call>{CALL}</tool_call>"} and len(seen) == 4  # 2 prompts × 2 episodes
    assert metrics["eval/held/pass@1"] == 1.0 and metrics["eval/held/failed"] == 0
    assert metrics["eval/held/response_length"] == 8  # sampled tokens of two turns, tool turn excluded


_held = threading.Event()
_release = threading.Event()


def _blocking(expression: str) -> str:
    """Holds until released."""
    _held.set()
    _release.wait(60)
    return "408"


blocking = FunctionTool(_blocking, name="calculator")


def test_an_abort_while_tools_run_ends_the_episodes_before_their_next_turn(scripted):
    model_dir, engine = scripted

    async def run():
        manager, client, _ = _manager(model_dir, engine, tools=[f"{__name__}:blocking"], max_turns=8)
        manager.submit(PromptItem("q", [1], messages=QUESTION))
        assert await asyncio.to_thread(_held.wait, 60)  # a tool call is running
        await manager.abort_all()
        _release.set()
        group = await manager.next_group(60)
        await client.close()
        return group, manager

    group, manager = asyncio.run(run())
    assert group.aborted and group.error is None and manager.stats["aborted"] == 1
    assert all(
        s.finish_reason == "abort" and s.episode.ended == "abort" and s.episode.turns == 1 for s in group.samples
    )
