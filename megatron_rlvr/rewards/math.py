"""Math answer verification: `verify_math(response, gold)` → 1.0 or 0.0.

In the caller's process, every step bounded: find the final answer (math_text), clean it
(math_latex), parse it into a tree (math_parse) and compare with exact numbers, canonical
forms and sampled values (math_compare, math_eval). Only pairs these cannot settle go to
sympy, in sandboxed worker processes with a hard per-answer timeout. Nothing here raises to
the caller or hangs: every failure is a 0.0 with a reason, and `MathVerifier.stats` counts
the reasons (the run logs them as `verifier/<reason>`).
"""

from __future__ import annotations

import atexit
import functools
from collections import Counter
from typing import cast

from megatron_rlvr.rewards.math_compare import FastBackend, compare
from megatron_rlvr.rewards.math_latex import clean, units
from megatron_rlvr.rewards.math_parse import parse_answer, text_node
from megatron_rlvr.rewards.math_text import AnswerError, extract_answers, gold_answer
from megatron_rlvr.rewards.math_tokens import tokenize
from megatron_rlvr.rewards.sandbox import SandboxPool
from megatron_rlvr.rewards.verdict import Verdict

_FAST = FastBackend()


def _same_tokens(a: str, b: str) -> bool:
    """Equal up to spacing that does not change meaning (3 : 4 and 3:4, but never 4e-1 and
    4e - 1)."""
    if a == b:
        return True
    try:
        return tokenize(a) == tokenize(b)
    except AnswerError:
        return False


def prepare(response: str, gold: str) -> Verdict | tuple[str, str]:
    """A verdict when the in-process checks decide, else the cleaned (pred, gold) for sympy."""
    try:
        if not isinstance(response, str) or not isinstance(gold, str):
            return 0.0, "not_a_string"
        gold_clean = clean(gold_answer(gold))
        pred_clean = ", ".join(clean(answer) for answer in extract_answers(response))
        if not pred_clean.strip(", "):
            return 0.0, "no_answer"
        if _same_tokens(pred_clean, gold_clean):
            return 1.0, "exact"
        pred_units, gold_units = units(pred_clean), units(gold_clean)
        if pred_units and gold_units and pred_units != gold_units:
            return 0.0, "unit_mismatch"  # 5 km is not 5 m (a unit on one side only is ignored)
        try:
            gold_tree = parse_answer(gold_clean)
        except AnswerError:  # a gold answer in prose: compare it as words
            equal = text_node(gold_clean) == text_node(pred_clean)
            return (1.0, "text_equal") if equal else (0.0, "gold_unparsed")
        equal, reason = compare(parse_answer(pred_clean), gold_tree, _FAST)
        if equal is None:
            return pred_clean, gold_clean
        return (1.0 if equal else 0.0), reason
    except AnswerError as err:
        return 0.0, err.reason
    except RecursionError:
        return 0.0, "too_deep"
    except Exception as err:  # a verifier must never take the caller down
        return 0.0, f"internal_error:{type(err).__name__}"


class MathVerifier:
    """Owns the sandbox worker pool; use as a context manager or call close()."""

    def __init__(self, timeout_s: float = 5.0, num_workers: int = 2, memory_mb: int = 1024):
        self.timeout_s = timeout_s
        self.pool = SandboxPool(num_workers=num_workers, memory_mb=memory_mb)
        self.stats: Counter[str] = Counter()

    def verify(self, response: str, gold: str, timeout_s: float | None = None) -> Verdict:
        return self.verify_batch([response], [gold], timeout_s)[0]

    def verify_batch(self, responses: list[str], golds: list[str], timeout_s: float | None = None) -> list[Verdict]:
        """Verdicts for many pairs; the undecided ones share the worker pool in parallel."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
        prepared = [prepare(r, g) for r, g in zip(responses, golds)]
        undecided = [i for i, p in enumerate(prepared) if isinstance(p[0], str)]
        verdicts: list[Verdict] = list(prepared)  # type: ignore[arg-type]
        if undecided:
            try:
                checked = self.pool.compare(
                    [cast(tuple[str, str], prepared[i]) for i in undecided], timeout_s or self.timeout_s
                )
            except Exception as err:
                checked = [(False, f"sandbox_error:{type(err).__name__}")] * len(undecided)
            for i, (equal, reason) in zip(undecided, checked):
                verdicts[i] = (1.0 if equal else 0.0, reason)
        self.stats.update(reason for _, reason in verdicts)
        return verdicts

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@functools.cache
def default_verifier() -> MathVerifier:
    """The process's shared verifier behind the function API: worker processes are costly
    to start, so they are made once, on first need, and stopped at interpreter exit."""
    verifier = MathVerifier()
    atexit.register(verifier.close)
    return verifier


def verify_math_detailed(response: str, gold: str, timeout_s: float = 5.0) -> Verdict:
    """(1.0 or 0.0, reason) for a model response against the gold answer."""
    return default_verifier().verify(response, gold, timeout_s)


def verify_math(response: str, gold: str, timeout_s: float = 5.0) -> float:
    """1.0 when the response's final answer equals the gold answer, else 0.0."""
    return verify_math_detailed(response, gold, timeout_s)[0]


def verify_math_batch(responses: list[str], golds: list[str], timeout_s: float = 5.0) -> list[Verdict]:
    """Batch form of verify_math_detailed, for throughput."""
    return default_verifier().verify_batch(responses, golds, timeout_s)
