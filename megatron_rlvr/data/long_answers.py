"""The built-in long-answer task: the remainder of n by d, found by subtracting d until what is
left is smaller than d, every step written out, then the answer in GSM8K's form, which the
math verifier reads:

    prompt "45%7="  →  response "45-7=38 38-7=31 31-7=24 24-7=17 17-7=10 10-7=3 #### 3"

The number of steps (n // d) is drawn from a truncated power law, so most answers are short
and a few are very long, as real RLVR responses are. Each step is local (the previous result,
the divisor from the prompt, one subtraction), so a tiny model can learn it; a long answer has
more steps to get wrong. worked_examples() writes solutions for the supervised cold start,
each step wrong with a given probability (a wrong step carries through to a wrong answer):
imitating them leaves room for RL.

    python tools/long_answer_stats.py [num_prompts [max_divisor [max_steps]]]   # lengths, problem counts
"""

from __future__ import annotations

import random
import statistics
import zlib

from megatron_rlvr.config import LongAnswerSource
from megatron_rlvr.data.records import LoadedPrompts, PromptRecord
from megatron_rlvr.rewards.long_answers import problem_of, prompt_text, worked_solution

# the characters the task writes; a tiny model for it needs them in model.tokenizer_chars
CHARS = "0123456789-=%# "
DATA_SOURCE = "long_answers"


def draw_problem(rng: random.Random, spec: LongAnswerSource) -> tuple[int, int]:
    """(n, d) of spec.split: steps = n // d drawn from P(k) ∝ k^-tail_exponent on
    1..max_steps (redrawn until the problem is in the split)."""
    ks = range(1, spec.max_steps + 1)
    weights = [k**-spec.tail_exponent for k in ks]
    for _ in range(10_000):  # the held-out eighth takes ~8 draws a problem
        steps = rng.choices(ks, weights=weights)[0]
        d = rng.randint(2, spec.max_divisor)
        n = steps * d + rng.randrange(d)
        split = problem_split(n, d)
        if spec.split in ("all", split) or (spec.split == "train" and split != "heldout"):
            return n, d
    raise AssertionError("no problem of the split in 10000 draws")


def is_heldout(n: int, d: int) -> bool:
    """The held-out eighth of all problems, the same whatever the seed: an eval set of split
    heldout never shares a problem with training data or cold-start data of split train."""
    return zlib.crc32(prompt_text(n, d).encode()) % 8 == 0


def problem_split(n: int, d: int) -> str:
    """heldout, or which half of the training problems (n, d) is in: train_sft, the half a cold
    start may train on, or train_rl, the half left for RL, on problems the cold start never
    saw (as held-out problems are to both)."""
    if is_heldout(n, d):
        return "heldout"
    return "train_rl" if zlib.crc32(f"rl:{prompt_text(n, d)}".encode()) % 2 else "train_sft"


def long_answer_prompts(spec: LongAnswerSource) -> LoadedPrompts:
    """The task's problems as one user message each, with the remainder as the answer."""
    rng = random.Random(spec.seed)
    records = []
    for i in range(spec.num_prompts):
        n, d = draw_problem(rng, spec)
        records.append(
            PromptRecord(f"long-{i}", [{"role": "user", "content": prompt_text(n, d)}], str(n % d), "math", DATA_SOURCE)
        )
    return LoadedPrompts(records)


def worked_examples(spec: LongAnswerSource, step_error_rate: float, seed: int) -> list[list[dict]]:
    """spec's problems as conversations with a worked answer (errors at step_error_rate),
    the assistant turn last: supervised cold-start data."""
    rng = random.Random(seed)
    conversations = []
    for record in long_answer_prompts(spec).records:
        assert isinstance(record.prompt, list)
        answer = worked_solution(*problem_of(record.prompt), rng, step_error_rate)
        conversations.append([*record.prompt, {"role": "assistant", "content": answer}])
    return conversations


def length_statistics(spec: LongAnswerSource) -> dict[str, float]:
    """Token lengths of the correct responses to spec's problems (a character tokenizer: one
    token per character, plus <eos>): median, p95, longest, and p95 / median."""
    lengths = sorted(len(worked_solution(n, d)) + 1 for n, d in _problems(spec))
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
    """How many distinct problems spec's settings can draw (n = k·d + r with 1 ≤ k ≤ max_steps,
    2 ≤ d ≤ max_divisor, 0 ≤ r < d), and how many of them are in each split. A small space is
    memorised by the cold start: its held-out pass@1 then says little about a training one."""
    problems = [
        (k * d + r, d) for d in range(2, spec.max_divisor + 1) for k in range(1, spec.max_steps + 1) for r in range(d)
    ]
    splits = [problem_split(n, d) for n, d in problems]
    heldout = splits.count("heldout")
    return {
        "all": len(problems),
        "train": len(problems) - heldout,
        "train_sft": splits.count("train_sft"),
        "train_rl": splits.count("train_rl"),
        "heldout": heldout,
    }


def _problems(spec: LongAnswerSource) -> list[tuple[int, int]]:
    rng = random.Random(spec.seed)
    return [draw_problem(rng, spec) for _ in range(spec.num_prompts)]


def main(argv: list[str]) -> int:
    """argv: [num_prompts [max_divisor [max_steps]]]."""
    spec = LongAnswerSource(
        num_prompts=int(argv[0]) if argv else 512,
        max_divisor=int(argv[1]) if len(argv) > 1 else 9,
        max_steps=int(argv[2]) if len(argv) > 2 else 24,
    )
    stats = length_statistics(spec)
    print(
        f"long_answers ({spec.num_prompts} problems, divisors 2..{spec.max_divisor}, "
        f"1..{spec.max_steps} steps, seed {spec.seed}): correct responses in tokens"
    )
    for key, value in stats.items():
        print(f"  {key:>16}: {value:g}")
    counts = problem_counts(spec)
    print(
        f"  distinct problems: {counts['all']} ({counts['train']} train: {counts['train_sft']} train_sft + "
        f"{counts['train_rl']} train_rl; {counts['heldout']} held out)"
    )
    n, d = _problems(spec)[0]
    print(f"  example: {prompt_text(n, d)} → {worked_solution(n, d)}")
    return 0
