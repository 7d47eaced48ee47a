"""The tool-calculator demo's task (megatron_rlvr/data/tool_arithmetic.py): problems a tiny
model cannot compute, split so no set shares a problem, cold-start traces whose slips are
exactly the ones asked for, and answers the math verifier scores."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlvr.data.tool_arithmetic import (
    ToolArithmetic,
    draw_problems,
    evaluate,
    parse_settings,
    problem_split,
    worked_trace,
    worked_traces,
    write_files,
)
from megatron_rlvr.rewards.math.verifier import verify_math

REPO = Path(__file__).resolve().parents[1]


def final_answer(trace: list[dict]) -> str:
    return trace[-1]["content"]


def test_files_are_deterministic_and_their_splits_share_no_problem(tmp_path):
    task = ToolArithmetic(train_prompts=300, sft_traces=300, heldout_prompts=40)
    first = write_files(task, tmp_path / "a")
    second = write_files(task, tmp_path / "b")
    assert all(first[k].read_bytes() == second[k].read_bytes() for k in first)
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in first.items()}
    train = {r["prompt"][0]["content"] for r in rows["train"]}
    heldout = {r["prompt"][0]["content"] for r in rows["heldout"]}
    sft = {r["messages"][0]["content"] for r in rows["sft"]}
    assert (len(train), len(heldout), len(sft)) == (300, 40, 300)  # distinct within each set
    assert not (train & heldout) and not (train & sft) and not (sft & heldout)
    assert {r["messages"][0]["content"] for r in rows["sft_direct"]} == sft
    for row in rows["heldout"]:
        expression = row["prompt"][0]["content"].removesuffix("=")
        assert problem_split(expression) == "heldout" and row["answer"] == str(evaluate(expression))
        operands = expression.replace("*", "+").split("+")
        assert len(operands) == 2 and all(task.min_digits <= len(x) <= task.max_digits for x in operands)


def test_without_slips_every_trace_calls_the_tool_right_and_copies_its_result():
    task = ToolArithmetic(slip_rate=0.0, sft_traces=200)
    for trace in worked_traces(task):
        user, call, tool, answer = trace
        expression = user["content"].removesuffix("=")
        assert call["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": expression}}
        assert tool == {"role": "tool", "name": "calculator", "content": str(evaluate(expression))}
        assert verify_math(answer["content"], str(evaluate(expression))) == 1.0


def test_slips_come_at_the_rate_asked_half_in_the_expression_half_in_the_copy():
    """Each slipped trace is wrong by exactly one digit, in the expression the tool ran (its
    result then copied faithfully) or in the copy of a right result; the answer verifies 0."""
    import random

    rng = random.Random(7)
    problems = draw_problems(ToolArithmetic(), "train_sft", 2000, seed=5)
    kinds = {"right": 0, "expression": 0, "copy": 0}
    for expression in problems:
        trace = worked_trace(expression, rng, slip_rate=0.4)
        written = trace[1]["tool_calls"][0]["function"]["arguments"]["expression"]
        result, answer = trace[2]["content"], final_answer(trace).removeprefix("#### ")
        assert result == str(evaluate(written))
        gold = str(evaluate(expression))
        if written != expression:
            assert sum(a != b for a, b in zip(written, expression, strict=True)) == 1 and answer == result
            kinds["expression"] += 1
        elif answer != result:
            assert sum(a != b for a, b in zip(answer, result, strict=True)) == 1
            kinds["copy"] += 1
        else:
            kinds["right"] += 1
            continue
        assert verify_math(final_answer(trace), gold) == 0.0  # operands are never 0: a slip changes the value
    share = (kinds["expression"] + kinds["copy"]) / len(problems)
    assert 0.36 < share < 0.44, kinds
    assert abs(kinds["expression"] - kinds["copy"]) < 0.1 * len(problems), kinds


@pytest.mark.parametrize(
    "argv, message",
    [
        (["slip_rate=2"], "slip_rate = 2.0: must be in [0, 1]"),
        (["slips=0.1"], "'slips=0.1' is not key=value with a key of"),
        (["min_digits=5", "max_digits=3"], "digits 5..3"),
        (["seed=x"], "seed = 'x' is not a number"),
    ],
)
def test_bad_settings_are_one_line_errors(argv, message):
    with pytest.raises(SystemExit) as err:
        parse_settings(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_command_writes_the_files_the_configs_name(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.data.tool_arithmetic",
            str(tmp_path),
            "train_prompts=10",
            "sft_traces=10",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "heldout.jsonl",
        "sft-direct.jsonl",
        "sft.jsonl",
        "train.jsonl",
    ]


def test_a_worked_trace_renders_to_the_ids_an_episode_produces(tmp_path):
    """The cold start trains on what RL samples: a trace (tool call in OpenAI layout) through the
    demo's template gives exactly the ids of an episode that writes the same call as text, gets
    the same result as its tool turn, and answers alike."""
    from megatron_rlvr.agent.render import TurnRenderer, check_template
    from megatron_rlvr.config import load_config
    from megatron_rlvr.data.arithmetic import build_arithmetic_tokenizer

    cfg = load_config(REPO / "configs" / "tool-calculator-sft-cpu.yaml")
    tokenizer = build_arithmetic_tokenizer(tmp_path, cfg.model.tokenizer_chars)
    template = (REPO / cfg.data.chat_template).read_text()
    renderer = TurnRenderer(tokenizer, chat_template=template)
    check_template(renderer)
    trace = worked_traces(ToolArithmetic(sft_traces=1, slip_rate=0.0))[0]
    user, call, tool, answer = trace
    arguments = json.dumps(call["tool_calls"][0]["function"]["arguments"])
    call_text = f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'

    def text_ids(text: str) -> list[int]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text  # every character the task writes is in the vocabulary
        return ids

    turn1 = text_ids(call_text) + [tokenizer.eos_token_id]
    bridge = renderer.bridge([user], call_text, [tool], turn1)
    assert bridge.broken is None and bridge.boundary == 0
    episode = renderer.prompt([user]) + turn1 + bridge.ids + text_ids(answer["content"]) + [tokenizer.eos_token_id]
    rendered = tokenizer.apply_chat_template(trace, tokenize=True, return_dict=False, chat_template=template)
    assert episode == rendered
    assert (
        len(rendered) <= cfg.sft.max_tokens
        and len(rendered) - len(renderer.prompt([user])) <= cfg.rollout.max_new_tokens
    )


def test_the_benchmark_runs_episodes_with_slow_tools_and_ends_with_its_ratio(tmp_path):
    """benchmarks/multi_turn.py, tiny: 4 episodes of the scripted model (a calculator call every
    turn), tools of 0 and 50 ms, both pools; the table and the last line `ratio: X`."""
    from agent_scripted import build_scripted_model

    model = build_scripted_model(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 12*34?"}]}) + "\n")
    args = ["--model", str(model), "--data", str(data), "--chat-template", "", "--episodes", "4", "--concurrency", "4"]
    args += ["--delays", "0", "0.05", "--max-turns", "3", "--max-new-tokens", "100"]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "multi_turn.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "ms" in line]
    assert [(r[0], r[1]) for r in rows] == [
        ("| 0 ms", "concurrent"),
        ("| 0 ms", "one at a time"),
        ("| 50 ms", "concurrent"),
        ("| 50 ms", "one at a time"),
    ]
    assert all(r[4] == "2.00" and r[5] == "3.00" for r in rows)  # two calls, the third turn's past max_turns
    assert lines[-1].startswith("ratio: ") and float(lines[-1].split()[1]) > 0


def test_a_run_state_holding_episodes_is_saved_and_read_back(tmp_path):
    """The RL stage's checkpoints save the buffer's samples; an episode's carries its stats
    (once a TypeError at the first save of every agent run)."""
    from megatron_rlvr.run_dir import dump_run_state, load_run_state
    from megatron_rlvr.samples import EpisodeStats, Sample

    stats = EpisodeStats(turns=2, tool_calls=1, tool_s=0.5, ended="answer", tool_rewards=[1.0], final_text="#### 7")
    sample = Sample("p", "g", 0, [1, 2], [3, 4, 5], [-0.1, 0.0, -0.2], "stop", "1", loss_mask=[1, 0, 1], episode=stats)
    state = {"step": 3, "buffer": [sample]}
    path = tmp_path / "state.json"
    path.write_bytes(dump_run_state(state))
    assert load_run_state(path) == state
