"""The long-answer task's working, as its verifiers read it: the written-out subtraction chain
of a remainder and its answer ("45-7=38 38-7=31 … #### 3"), and the rewards that check it.
Light on imports on purpose: a verifier function runs in a fresh sandbox process per group,
and importing the data package (config, tokenizers) there cost ~0.5 s a group."""

from __future__ import annotations

import random


def prompt_text(n: int, d: int) -> str:
    return f"{n}%{d}="


def worked_solution(n: int, d: int, rng: random.Random | None = None, step_error_rate: float = 0.0) -> str:
    """The written-out subtraction chain and '#### answer'. With step_error_rate, each step's
    result is off by one with that probability (never below 0) until one is, and the chain
    goes on from the wrong value: the final answer is then wrong (one off, modulo d)."""
    parts, x, erred = [], n, False
    while x >= d:
        result = x - d
        if rng is not None and not erred and step_error_rate and rng.random() < step_error_rate:
            result, erred = result + 1 if result == 0 or rng.random() < 0.5 else result - 1, True
        parts.append(f"{x}-{d}={result}")
        x = result
    return " ".join([*parts, f"#### {x}"])


def problem_of(prompt: str | list[dict]) -> tuple[int, int]:
    """(n, d) of a prompt_text, given as the text or as messages whose last one holds it."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    n, d = (int(x) for x in text.rstrip("=").split("%"))
    return n, d


def verify_working(response: str, record: dict) -> float:
    """A stricter reward than the math verifier's (verifier.functions): 1 only when the whole
    working is the correct chain and its answer, so a guessed '#### r' earns nothing (with
    divisors up to 5, a guess is right one time in three: RL on the answer alone learns to
    skip the working of long problems and guess)."""
    return float(response.strip() == worked_solution(*problem_of(record["prompt"])))


def verify_steps(response: str, record: dict) -> float:
    """Partial credit: the share of the correct chain's units (each step, then '#### r') that
    the response writes before its first mistake; 1 only for the whole correct working, so
    pass@k (reward >= 1) stays verify_working's. Under all-or-nothing rewards every sample of
    a long problem fails and its group carries no gradient; here it ranks them by how far
    they got right, and nothing is gained by stopping early."""
    gold = worked_solution(*problem_of(record["prompt"])).split(" ")
    gold = [*gold[:-2], " ".join(gold[-2:])]  # the steps, then '#### r' as one unit
    got = response.strip().split(" ")
    got = [*got[: len(gold) - 1], " ".join(got[len(gold) - 1 :])]
    right = next((i for i, (a, b) in enumerate(zip(got, gold)) if a != b), min(len(got), len(gold)))
    return right / len(gold)
