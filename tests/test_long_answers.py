"""The built-in long-answer task: its length statistics, its answers as the math verifier
reads them, its held-out split, and the error rate of its worked solutions."""

import random
import statistics
from pathlib import Path

import pytest

from megatron_rlvr.config import LongAnswerSource, load_config
from megatron_rlvr.data import build_arithmetic_tokenizer, load_data
from megatron_rlvr.data.long_answers import (
    CHARS,
    draw_problem,
    is_heldout,
    length_statistics,
    problem_split,
)
from megatron_rlvr.rewards.long_answers import count_prompt, count_solution, digits_of, solution, worked_solution
from megatron_rlvr.rewards.math.verifier import verify_math

# the demo's problem (configs/long-answers*.yaml)
ODD_COUNT = {"problem": "odd_count", "max_steps": 32, "tail_exponent": 1.0}

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("settings", [{}, ODD_COUNT], ids=["remainder", "odd_count"])
def test_correct_responses_are_long_and_long_tailed(settings):
    stats = length_statistics(LongAnswerSource(**settings))
    assert stats["median"] >= 24
    assert stats["p95"] >= 4 * stats["median"]
    assert stats["max"] >= 160


def test_lengths_count_the_character_tokenizers_tokens(tmp_path):
    tokenizer = build_arithmetic_tokenizer(tmp_path, CHARS)
    longest = count_solution([7] * 52)
    for text in (worked_solution(88, 8), worked_solution(5, 2), worked_solution(217, 9), longest):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_the_math_verifier_scores_worked_solutions():
    assert worked_solution(45, 7) == "45-7=38 38-7=31 31-7=24 24-7=17 17-7=10 10-7=3 #### 3"
    records = load_data(LongAnswerSource(num_prompts=50), load_config(None).verifier).records
    for record in records:
        n, d = (int(x) for x in record.prompt[0]["content"].rstrip("=").split("%"))
        assert verify_math(worked_solution(n, d), record.answer) == 1.0
        assert verify_math(worked_solution(n, d, random.Random(0), step_error_rate=1.0), record.answer) == 0.0


def test_an_odd_count_solution_counts_the_odd_digits_step_by_step():
    assert count_solution([5, 8, 3]) == "a5=1 b8=1 c3=2 #### 2"
    rng = random.Random(4)
    for _ in range(200):
        digits = [rng.randrange(10) for _ in range(rng.randint(1, 52))]
        steps = count_solution(digits).split(" ")
        assert steps[-1] == str(sum(x % 2 for x in digits)) and len(steps) == len(digits) + 2
        assert digits_of(steps_prompt := "".join(s[:2] for s in steps[:-2]) + "=") == digits, steps_prompt
    with pytest.raises(ValueError, match="not an odd_count problem"):
        digits_of("a5c8=")  # a label skipped


@pytest.mark.parametrize("settings", [{}, ODD_COUNT], ids=["remainder", "odd_count"])
@pytest.mark.parametrize("rate", [0.02, 0.1])
def test_the_step_error_rate_sets_how_often_a_worked_solution_is_right(rate, settings):
    spec = LongAnswerSource(num_prompts=4000, seed=5, **settings)
    rng, draw = random.Random(1), random.Random(spec.seed)
    problems = [draw_problem(draw, spec) for _ in range(spec.num_prompts)]
    right = [verify_math(solution(p, rng, rate), solution(p).rpartition(" ")[2]) for p in problems]
    steps = [len(solution(p).split(" ")) - 2 for p in problems]
    expected = statistics.fmean((1 - rate) ** k for k in steps)  # every step right
    assert statistics.fmean(right) == pytest.approx(expected, abs=0.03)


def test_odd_count_problems_are_too_many_to_recall_and_at_most_52_digits():
    from megatron_rlvr.data.long_answers import problem_counts

    spec = LongAnswerSource(num_prompts=2000, split="heldout", **ODD_COUNT)
    assert problem_counts(spec)["all"] > 10**32
    prompts = [r.prompt[0]["content"] for r in load_data(spec, load_config(None).verifier).records]
    assert all(is_heldout(p) for p in prompts)
    long = [p for p in prompts if len(p) > 2 * 8]  # 8 digits or more: a third of the draws, never one twice
    assert len(long) > 500 and len(set(long)) == len(long)
    with pytest.raises(ValueError, match="at most 52 digits"):
        LongAnswerSource(problem="odd_count", max_steps=53)


def test_the_heldout_split_shares_no_problem_with_training_data():
    def problems(split: str, seed: int) -> set[str]:
        spec = LongAnswerSource(num_prompts=400, split=split, seed=seed)
        return {r.prompt[0]["content"] for r in load_data(spec, load_config(None).verifier).records}

    train, heldout = problems("train", 0), problems("heldout", 1)
    assert train and heldout and not train & heldout
    assert all(is_heldout(p) for p in heldout)
    # the halves of train a cold start and an RL run take: disjoint, and each inside train
    cold_start, rl = problems("train_sft", 2), problems("train_rl", 3)
    assert cold_start and rl and not cold_start & rl and not (cold_start | rl) & heldout
    split_of = {p: problem_split(p) for p in train | cold_start | rl}
    assert {split_of[p] for p in cold_start} == {"train_sft"} and {split_of[p] for p in rl} == {"train_rl"}
    assert {split_of[p] for p in train} == {"train_sft", "train_rl"}  # train is the two halves


def test_the_working_verifier_rewards_the_whole_chain_and_not_a_guess():
    from megatron_rlvr.rewards.long_answers import verify_working

    record = {"prompt": [{"role": "user", "content": "45%7="}]}
    assert verify_working(worked_solution(45, 7), record) == 1.0
    assert verify_working("45-7=38 #### 3", record) == 0.0  # the right answer, guessed
    assert verify_working(worked_solution(45, 7).replace("31", "30", 1), record) == 0.0
    assert verify_math("45-7=38 #### 3", "3") == 1.0  # the math verifier reads the answer only
    counting = {"prompt": [{"role": "user", "content": "a5b8c3="}]}
    assert verify_working("a5=1 b8=1 c3=2 #### 2", counting) == 1.0
    assert verify_working("a5=1 b8=2 c3=2 #### 2", counting) == 0.0  # a wrong step, the right answer
    assert verify_working("#### 2", counting) == 0.0


@pytest.mark.parametrize("name", ["long-answers-cpu.yaml", "long-answers-sft-cpu.yaml", "compare-replay-long-cpu.yaml"])
def test_the_shipped_long_answer_configs_score_every_prompt_by_its_working(name, shipped_overrides):
    """verifier.by_data_source reaches the built-in task's records, training data and eval sets
    alike (it once reached file rows only, and every long-answer run was scored on the answer
    alone: GRPO learned to drop the working and guess)."""
    from megatron_rlvr.data.check import load_all

    path = REPO / "configs" / name
    loaded = load_all(load_config(path, shipped_overrides(path)), report=False)
    assert loaded and all(r.verifier == "long_answers_working" for part in loaded.values() for r in part.records)


def test_the_shipped_working_verifier_runs_in_process_with_the_sandboxs_verdicts(shipped_overrides):
    """The project's own verifier functions skip the sandbox (a supervisor per group cost 0.23 s
    of the learner's core: in flight became learner-bound); what they return, raise or refuse
    is judged as in the sandbox."""
    from megatron_rlvr.rewards.custom import FunctionVerifier, InProcessFunction, resolve_function
    from megatron_rlvr.rewards.registry import Verifiers

    path = REPO / "configs" / "long-answers-cpu.yaml"
    cfg = load_config(path, shipped_overrides(path)).verifier
    verifiers = Verifiers(cfg, {k: resolve_function(v, REPO) for k, v in cfg.functions.items()})
    in_process = verifiers.functions["long_answers_working"]
    assert isinstance(in_process, InProcessFunction)
    sandboxed = FunctionVerifier(
        resolve_function(cfg.functions["long_answers_working"], REPO), timeout_s=5, memory_mb=512
    )
    responses = [worked_solution(45, 7), "45-7=38 #### 3", worked_solution(45, 7).replace("31", "30", 1), ""]
    record = {"prompt": [{"role": "user", "content": "45%7="}]}
    expected = [(1.0, "scored"), (0.0, "scored"), (0.0, "scored"), (0.0, "scored")]
    assert in_process.verify_batch(responses, record) == sandboxed.verify_batch(responses, record) == expected
    broken = {"prompt": "not a problem"}  # raises in the function: a runtime_error either way
    assert in_process.verify_batch(["x"], broken) == sandboxed.verify_batch(["x"], broken) == [(0.0, "runtime_error")]


def test_the_working_verifiers_import_light():
    """Named by file path (`megatron_rlvr/rewards/long_answers.py:verify_working`) they run in a
    fresh sandbox process per group: importing the data package there (config, tokenizers) cost
    ~0.5 s a group, more than a training step's verification should."""
    import subprocess
    import sys

    code = "import sys, megatron_rlvr.rewards.long_answers; print(sorted({'pydantic', 'transformers', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_partial_credit_is_the_share_right_before_the_first_mistake_and_one_only_when_whole():
    from megatron_rlvr.rewards.long_answers import verify_steps

    record = {"prompt": "45%7="}  # 6 steps and '#### 3': 7 units
    whole = worked_solution(45, 7)
    assert verify_steps(whole, record) == 1.0
    assert verify_steps(whole.replace("24-7=17", "24-7=16 16-7=9", 1), record) == 3 / 7
    assert verify_steps(whole.replace("#### 3", "#### 4"), record) == 6 / 7
    assert verify_steps(whole + " 3-7=0", record) == 6 / 7  # past the answer is not the answer
    assert verify_steps("45-7=38 38-7=31", record) == 2 / 7  # stopping early gains nothing
    assert verify_steps("45-7=38 #### 3", record) == 1 / 7  # nor does a guess
    assert verify_steps("", record) == 0.0


def test_the_problem_counts_are_the_space_the_draws_come_from():
    from megatron_rlvr.data.long_answers import problem_counts

    spec = LongAnswerSource(num_prompts=3000, max_divisor=5, max_steps=24, split="all", seed=3)
    counts = problem_counts(spec)
    assert counts["all"] == 48 + 72 + 96 + 120 and counts["train"] + counts["heldout"] == counts["all"]
    rng = random.Random(spec.seed)
    drawn = {draw_problem(rng, spec) for _ in range(spec.num_prompts)}
    assert len(drawn) <= counts["all"] and sum(is_heldout(p) for p in drawn) <= counts["heldout"]


def test_the_stats_tool_prints_the_demos_lengths_and_refuses_bad_settings_in_one_line(capsys):
    from megatron_rlvr.data.long_answers import main

    assert main(["problem=odd_count", "max_steps=32", "tail_exponent=1.0"]) == 0
    out = capsys.readouterr().out
    assert "median: 27" in out and "p95: 139" in out and "max: 180" in out
    for bad, says in (["512"], "'512' is not key=value"), (["problem=odd_count", "max_steps=60"], "at most 52"):
        with pytest.raises(SystemExit, match=says):
            main(bad)


def test_the_length_table_places_each_wrong_answer_and_each_length():
    """tools/long_answer_lengths.py: a wrong answer is placed at the part of its first wrong
    step (the label, the digit read from the prompt, the count) or the end; lists of 8 digits
    or more share one row; greedy and sampled accuracy are per problem of that length."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lengths", Path(__file__).parents[1] / "tools/long_answer_lengths.py")
    lengths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lengths)
    gold = solution("a5b8c3=")
    assert gold == "a5=1 b8=1 c3=2 #### 2"
    assert lengths.first_wrong_part("a5=1 b9=2 c3=3 #### 3", gold) == "digit"
    assert lengths.first_wrong_part("a5=1 b8=2 c3=3 #### 3", gold) == "count"
    assert lengths.first_wrong_part("a5=1 c8=1 c3=2 #### 2", gold) == "label"
    assert lengths.first_wrong_part("a5=1 b8=1 c3=2 #### 3", gold) == "the end"
    assert lengths.first_wrong_part("a5=1 b8=1", gold) == "the end"
    long_gold = solution(count_prompt(list(range(10))))
    rows = lengths.by_length(
        [gold, gold, long_gold, solution("a2=")],
        [gold, "a5=1 b9=2 c3=3 #### 3", long_gold, "a2=1 #### 1"],
        [[gold, "x"], [gold, gold], ["y", "z"], ["a2=0 #### 0", "a2=0 #### 0"]],
    )
    assert list(rows) == [1, 3, 8]
    assert (rows[3]["problems"], rows[3]["greedy"], rows[3]["sampled"]) == (2, 1, 1.5)
    assert rows[3]["wrong"] == {"digit": 1}
    assert (rows[8]["problems"], rows[8]["greedy"], rows[8]["sampled"]) == (1, 1, 0.0)
    assert (rows[1]["greedy"], rows[1]["sampled"], rows[1]["wrong"]) == (0, 1.0, {"count": 1})
