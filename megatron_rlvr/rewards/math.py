"""Math answer verification: `verify_math(response, gold)` → 1.0 or 0.0.

Fast checks run in the caller (exact string after normalisation, exact rational
comparison); only what they cannot decide goes to sympy, in sandboxed worker processes
with a hard per-answer timeout. Nothing here raises to the caller or hangs: every failure is
a 0.0 with a reason, and `MathVerifier.stats` counts the reasons.
"""

from __future__ import annotations

import atexit
import functools
from collections import Counter

from megatron_rlvr.rewards.math_text import (
    AnswerError,
    compact,
    extract_answer,
    last_boxed,
    normalize,
    parse_number,
)
from megatron_rlvr.rewards.sandbox import SandboxPool

Verdict = tuple[float, str]


def _prepare(response: str, gold: str) -> Verdict | tuple[str, str]:
    """A verdict when the string-level checks decide, else the normalised (pred, gold)."""
    try:
        if not isinstance(response, str) or not isinstance(gold, str):
            return 0.0, "not_a_string"
        gold_norm = normalize(last_boxed(gold) or gold)
        pred_norm = normalize(extract_answer(response))
        if not pred_norm:
            return 0.0, "no_answer"
        if compact(pred_norm) == compact(gold_norm):
            return 1.0, "exact"
        pred_num, gold_num = parse_number(pred_norm), parse_number(gold_norm)
        if pred_num is not None and gold_num is not None:
            return (1.0, "numeric_equal") if pred_num == gold_num else (0.0, "numeric_mismatch")
        return pred_norm, gold_norm
    except AnswerError as err:
        return 0.0, err.reason
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

    def verify_batch(
        self, responses: list[str], golds: list[str], timeout_s: float | None = None
    ) -> list[Verdict]:
        """Verdicts for many pairs; the undecided ones share the worker pool in parallel."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
        prepared = [_prepare(r, g) for r, g in zip(responses, golds)]
        undecided = [i for i, p in enumerate(prepared) if isinstance(p[0], str)]
        verdicts: list[Verdict] = list(prepared)  # type: ignore[arg-type]
        if undecided:
            try:
                checked = self.pool.compare(
                    [prepared[i] for i in undecided], timeout_s or self.timeout_s
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


def verify_math_batch(
    responses: list[str], golds: list[str], timeout_s: float = 5.0
) -> list[Verdict]:
    """Batch form of verify_math_detailed, for throughput."""
    return default_verifier().verify_batch(responses, golds, timeout_s)
