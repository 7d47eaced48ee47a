"""The long-answer task's working, as its verifiers read it, and the rewards that check it.
Two problems: a remainder by written-out subtraction ("45%7=" → "45-7=38 38-7=31 … #### 3"),
and a running count of the odd digits of a labelled list ("a5b8c3=" → "a5=1 b8=1 c3=2 #### 2").
Light on imports on purpose: a verifier function runs in a fresh sandbox process per group,
and importing the data package (config, tokenizers) there cost ~0.5 s a group."""

from __future__ import annotations

import random
import string

# the labels of an odd_count problem's digits, in order: a problem has at most 52
INDEX = string.ascii_lowercase + string.ascii_uppercase


def prompt_text(n: int, d: int) -> str:
    return f"{n}%{d}="


def worked_solution(n: int, d: int, rng: random.Random | None = None, step_error_rate: float = 0.0) -> str:
    """The written-out subtraction chain and '#### answer'. With step_error_rate, each step's
    result is off by one with that probability (never below 0) until one is, and the chain
    goes on from the wrong value: the final answer is then wrong (one off, modulo d)."""
    parts, x, erred = [], n, False
    while x >= d:
        result, erred = _slip(x - d, rng, step_error_rate, erred)
        parts.append(f"{x}-{d}={result}")
        x = result
    return " ".join([*parts, f"#### {x}"])


def _slip(value: int, rng: random.Random | None, step_error_rate: float, erred: bool) -> tuple[int, bool]:
    """A step's result, off by one (never below 0) with probability step_error_rate while no
    earlier step of the solution slipped; and whether one has now."""
    if rng is None or erred or not step_error_rate or rng.random() >= step_error_rate:
        return value, erred
    return (value + 1 if value == 0 or rng.random() < 0.5 else value - 1), True


def count_prompt(digits: list[int]) -> str:
    """An odd_count problem: each digit after its label ("a5b8c3=")."""
    return "".join(f"{INDEX[i]}{x}" for i, x in enumerate(digits)) + "="


def count_solution(digits: list[int], rng: random.Random | None = None, step_error_rate: float = 0.0) -> str:
    """The running count of odd digits, one step per digit (its label, the digit, the count
    so far), then '#### count'. With step_error_rate, each step's count is off by one with
    that probability (never below 0) until one is, and the count goes on from the wrong value:
    the answer is then wrong by one."""
    parts, count, erred = [], 0, False
    for i, x in enumerate(digits):
        count, erred = _slip(count + x % 2, rng, step_error_rate, erred)
        parts.append(f"{INDEX[i]}{x}={count}")
    return " ".join([*parts, f"#### {count}"])


def _text(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def problem_of(prompt: str | list[dict]) -> tuple[int, int]:
    """(n, d) of a prompt_text, given as the text or as messages whose last one holds it."""
    n, d = (int(x) for x in _text(prompt).rstrip("=").split("%"))
    return n, d


def digits_of(prompt: str | list[dict]) -> list[int]:
    """The digits of a count_prompt, checked against their labels."""
    body = _text(prompt).removesuffix("=")
    labels, digits = body[0::2], body[1::2]
    if labels != INDEX[: len(labels)] or len(digits) != len(labels) or not digits.isdigit():
        raise ValueError(f"not an odd_count problem: {_text(prompt)!r}")
    return [int(x) for x in digits]


def solution(prompt: str | list[dict], rng: random.Random | None = None, step_error_rate: float = 0.0) -> str:
    """The worked solution of either problem, with errors at step_error_rate when rng is given."""
    if "%" in _text(prompt):
        return worked_solution(*problem_of(prompt), rng, step_error_rate)
    return count_solution(digits_of(prompt), rng, step_error_rate)


def verify_working(response: str, record: dict) -> float:
    """A stricter reward than the math verifier's (verifier.functions): 1 only when the whole
    working is the correct chain and its answer, so a guessed '#### r' earns nothing (with
    divisors up to 5, a guess is right one time in three: RL on the answer alone learns to
    skip the working of long problems and guess)."""
    return float(response.strip() == solution(record["prompt"]))


def verify_steps(response: str, record: dict) -> float:
    """Partial credit: the share of the correct chain's units (each step, then '#### r') that
    the response writes before its first mistake; 1 only for the whole correct working, so
    pass@k (reward >= 1) stays verify_working's. Under all-or-nothing rewards every sample of
    a long problem fails and its group carries no gradient; here it ranks them by how far
    they got right, and nothing is gained by stopping early."""
    gold = solution(record["prompt"]).split(" ")
    gold = [*gold[:-2], " ".join(gold[-2:])]  # the steps, then '#### r' as one unit
    got = response.strip().split(" ")
    got = [*got[: len(gold) - 1], " ".join(got[len(gold) - 1 :])]
    return first_mismatch(got, gold) / len(gold)


def first_mismatch(got: list[str], gold: list[str]) -> int:
    """The index of the first unit where got leaves gold (the shorter one's length if neither
    does before it ends)."""
    return next((i for i, (a, b) in enumerate(zip(got, gold)) if a != b), min(len(got), len(gold)))
