"""Every regular expression of the math verifier (each module-level pattern in
megatron_rlvr/rewards/math/*.py) run over long adversarial texts, by search and by full match:
unclosed brackets, long runs of letters, digits, blanks and separators, nested braces. Each text
is read at SIZE and at 4 * SIZE characters; a pattern whose processor time grows more than
twice as fast as the text (a linear one grows ×4, a quadratic one ×16) is named, and the run
exits 1. An exponential one never finishes: its caller's bound stops it, and the last name
printed says which. Run by tests/test_math_bounded.py in a child process."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import time

import megatron_rlvr.rewards as rewards

SIZE = 10_000
NOISE_S = 0.02  # below this much processor time at 4 * SIZE, growth is not judged
SEEDS = [
    *"1 ,.([{\\$'_^-a", "so", "1,", "1.", "a=", "a_", "(a", "[1 ", "{1}", "1,\\!", "]1,", "1_", "\\,1",
    "**", "\\text{a", "\\frac{", "\\boxed{", "\\(", "\\[", "$$", "10^", "1'", "\\mu ", "and ", "the answer is ",
]  # fmt: skip
SHAPED = [("5 (", "so", ""), ("\\boxed{[", " ", "1}"), ("1.", "1", ""), ("a=", " ", "x"), ("[", "1 ", "")]


def patterns() -> list[tuple[str, re.Pattern]]:
    found = []
    for module in pkgutil.iter_modules(rewards.__path__):
        if module.name.startswith("math"):
            loaded = importlib.import_module(f"megatron_rlvr.rewards.{module.name}")
            found += [(f"{module.name}.{name}", v) for name, v in vars(loaded).items() if isinstance(v, re.Pattern)]
    return found


def texts(size: int) -> list[str]:
    return [seed * (size // len(seed)) for seed in SEEDS] + [a + b * (size // len(b)) + c for a, b, c in SHAPED]


def cost(pattern: re.Pattern, text: str) -> float:
    start = time.process_time()
    for _ in pattern.finditer(text):
        pass
    pattern.fullmatch(text)
    return time.process_time() - start


def main() -> int:
    found, short, long = patterns(), texts(SIZE), texts(4 * SIZE)
    slow = []
    for name, pattern in found:
        print(name, flush=True)
        for a, b in zip(short, long):
            t_short, t_long = cost(pattern, a), cost(pattern, b)
            if t_long > NOISE_S and t_long > 8 * t_short:
                slow.append(f"{name} on {b[:24]!r}...: {t_short:.3f} s at {len(a)} chars, {t_long:.3f} s at {len(b)}")
    print("\n".join(slow) or f"done: {len(found)} patterns, {len(long)} texts, all linear", flush=True)
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
