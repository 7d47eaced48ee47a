"""The built-in long-answer task: every step written out, then the answer in GSM8K's form,
which the math verifier reads. Two problems (`problem`):

    remainder   "45%7="    →  "45-7=38 38-7=31 31-7=24 24-7=17 17-7=10 10-7=3 #### 3"
    odd_count   "a5b8c3="  →  "a5=1 b8=1 c3=2 #### 2"   (the running count of odd digits)

The number of steps (n // d, or the number of digits) is drawn from a truncated power law, so
most answers are short and a few are very long, as real RLVR responses are. A tiny model learns
the remainder's steps as recall keyed on the prompt (its space is a few hundred problems); an
odd_count problem is one of 10^k, so whatever a model learns of it is the rule, and held-out
problems measure that. worked_examples() writes solutions for the supervised cold start, each
step wrong with a given probability (a wrong step carries through to a wrong answer):
imitating them leaves room for RL.

    python tools/long_answer_stats.py [key=value ...]   # lengths, problem counts (e.g. problem=odd_count)
"""

from __future__ import annotations

import random
import statistics
import zlib

from pydantic import ValidationError

from megatron_rlvr.config import LongAnswerSource
from megatron_rlvr.data.records import LoadedPrompts, PromptRecord
from megatron_rlvr.rewards.long_answers import INDEX, count_prompt, prompt_text, solution

# the characters the task writes; a tiny model for it needs them in model.tokenizer_chars
CHARS = "0123456789-=%# " + INDEX
DATA_SOURCE = "long_answers"


def draw_problem(rng: random.Random, spec: LongAnswerSource) -> str:
    """A prompt of spec.problem in spec.split: its number of steps drawn from
    P(k) ∝ k^-tail_exponent on 1..max_steps (redrawn until the problem is in the split)."""
    ks = range(1, spec.max_steps + 1)
    weights = [k**-spec.tail_exponent for k in ks]
    for _ in range(10_000):  # the held-out eighth takes ~8 draws a problem
        steps = rng.choices(ks, weights=weights)[0]
        if spec.problem == "odd_count":
            prompt = count_prompt([rng.randrange(10) for _ in range(steps)])
        else:
            d = rng.randint(2, spec.max_divisor)
            prompt = prompt_text(steps * d + rng.randrange(d), d)
        split = problem_split(prompt)
        if spec.split in ("all", split) or (spec.split == "train" and split != "heldout"):
            return prompt
    raise AssertionError("no problem of the split in 10000 draws")


def is_heldout(prompt: str) -> bool:
    """The held-out eighth of all problems, the same whatever the seed: an eval set of split
    heldout never shares a problem with training data or cold-start data of split train."""
    return zlib.crc32(prompt.encode()) % 8 == 0


def problem_split(prompt: str) -> str:
    """heldout, or which half of the training problems the prompt is in: train_sft, the half
    a cold start may train on, or train_rl, the half left for RL, on problems the cold start
    never saw (as held-out problems are to both)."""
    if is_heldout(prompt):
        return "heldout"
    return "train_rl" if zlib.crc32(f"rl:{prompt}".encode()) % 2 else "train_sft"


def long_answer_prompts(spec: LongAnswerSource) -> LoadedPrompts:
    """The task's problems as one user message each, with the final answer as the answer."""
    rng = random.Random(spec.seed)
    records = []
    for i in range(spec.num_prompts):
        prompt = draw_problem(rng, spec)
        answer = solution(prompt).rpartition("#### ")[2]
        records.append(PromptRecord(f"long-{i}", [{"role": "user", "content": prompt}], answer, "math", DATA_SOURCE))
    return LoadedPrompts(records)


def worked_examples(spec: LongAnswerSource, step_error_rate: float, seed: int) -> list[list[dict]]:
    """spec's problems as conversations with a worked answer (errors at step_error_rate),
    the assistant turn last: supervised cold-start data."""
    rng = random.Random(seed)
    conversations = []
    for record in long_answer_prompts(spec).records:
        assert isinstance(record.prompt, list)
        answer = solution(record.prompt, rng, step_error_rate)
        conversations.append([*record.prompt, {"role": "assistant", "content": answer}])
    return conversations


def length_statistics(spec: LongAnswerSource) -> dict[str, float]:
    """Token lengths of the correct responses to spec's problems (a character tokenizer: one
    token per character, plus <eos>): median, p95, longest, and p95 / median."""
    lengths = sorted(len(solution(prompt)) + 1 for prompt in _problems(spec))
    p95 = lengths[min(len(lengths) - 1, round(0.95 * (len(lengths) - 1)))]
    median = statistics.median(lengths)
    return {
        "problems": len(lengths),
        "mean": statistics.fmean(lengths),
        "median": median,
        "p95": p95,
        "max": lengths[-1],
        "p95_over_median": p95 / median,
    }


def problem_counts(spec: LongAnswerSource) -> dict[str, int]:
    """How many distinct problems spec's settings can draw, and how many of them are in each
    split. A small space is memorised by the cold start: its held-out pass@1 then says little
    about a training one. remainder: n = k·d + r with 1 ≤ k ≤ max_steps, 2 ≤ d ≤ max_divisor,
    0 ≤ r < d; odd_count: 10 + 100 + … + 10^max_steps, too many to split one by one (an eighth
    is held out, by hash), so only "all" is counted."""
    if spec.problem == "odd_count":
        return {"all": sum(10**k for k in range(1, spec.max_steps + 1))}
    problems = [
        prompt_text(k * d + r, d)
        for d in range(2, spec.max_divisor + 1)
        for k in range(1, spec.max_steps + 1)
        for r in range(d)
    ]
    splits = [problem_split(prompt) for prompt in problems]
    heldout = splits.count("heldout")
    return {
        "all": len(problems),
        "train": len(problems) - heldout,
        "train_sft": splits.count("train_sft"),
        "train_rl": splits.count("train_rl"),
        "heldout": heldout,
    }


def _problems(spec: LongAnswerSource) -> list[str]:
    rng = random.Random(spec.seed)
    return [draw_problem(rng, spec) for _ in range(spec.num_prompts)]


def main(argv: list[str]) -> int:
    """argv: the task's settings as key=value (e.g. problem=odd_count max_steps=32), 512 problems
    unless num_prompts is given."""
    malformed = [arg for arg in argv if "=" not in arg]
    if malformed:
        raise SystemExit(f"long_answer_stats: {malformed[0]!r} is not key=value (e.g. problem=odd_count max_steps=32)")
    settings = dict(arg.split("=", 1) for arg in argv)
    try:
        spec = LongAnswerSource(**{"num_prompts": 512, **settings})
    except ValidationError as err:  # the first problem, on one line
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"])) or "settings"
        raise SystemExit(f"long_answer_stats: {where}: {first['msg']}") from None
    stats = length_statistics(spec)
    shape = f"divisors 2..{spec.max_divisor}" if spec.problem == "remainder" else "digits 0..9"
    print(
        f"long_answers {spec.problem} ({spec.num_prompts} problems, {shape}, 1..{spec.max_steps} steps, "
        f"tail exponent {spec.tail_exponent:g}, seed {spec.seed}): correct responses in tokens"
    )
    for key, value in stats.items():
        print(f"  {key:>16}: {value:g}")
    counts = problem_counts(spec)
    if spec.problem == "odd_count":
        print(f"  distinct problems: {counts['all']:.3g} (an eighth held out, by hash)")
    else:
        print(
            f"  distinct problems: {counts['all']} ({counts['train']} train: {counts['train_sft']} train_sft + "
            f"{counts['train_rl']} train_rl; {counts['heldout']} held out)"
        )
    prompt = _problems(spec)[0]
    print(f"  example: {prompt} → {solution(prompt)}")
    return 0
