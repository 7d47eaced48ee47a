"""Math answer verification: `verify_math(response, gold)` → 1.0 or 0.0.

Every pair is decided in a sandboxed worker process under a hard per-pair deadline (workers.py):
find the final answer (math.text), clean it (math.latex), read what it commits to (math.answer:
an exact value before its approximation, the value after a label, a decimal comma), refuse a
different unit (math.units: 12 kJ is not 12 J), parse it into a tree (math.parse) and compare
with exact numbers, canonical forms and sampled values (math.compare, math.evaluate), then sympy for
what these cannot settle (math.verdict, math.symbolic). Nothing here raises to the caller or hangs:
a worker past the deadline is killed and replaced and its pair is (0.0, "timeout"); every
failure is a 0.0 with a reason, and `MathVerifier.stats` counts the reasons (the run logs them
as `verifier/<reason>`).
"""

from __future__ import annotations

import atexit
import functools
from collections import Counter

from megatron_rlvr.rewards.math.workers import SandboxPool
from megatron_rlvr.rewards.verdict import Verdict


class MathVerifier:
    """Owns the sandbox worker pool; use as a context manager or call close()."""

    def __init__(self, timeout_s: float = 5.0, num_workers: int = 2, memory_mb: int = 1024):
        self.timeout_s = timeout_s
        self.pool = SandboxPool(num_workers=num_workers, memory_mb=memory_mb)
        self.stats: Counter[str] = Counter()

    def verify(self, response: str, gold: str, timeout_s: float | None = None) -> Verdict:
        return self.verify_batch([response], [gold], timeout_s)[0]

    def verify_batch(self, responses: list[str], golds: list[str], timeout_s: float | None = None) -> list[Verdict]:
        """Verdicts for many pairs, decided in parallel by the worker pool, each within the timeout."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
        pairs = [(r, g) if isinstance(r, str) and isinstance(g, str) else None for r, g in zip(responses, golds)]
        strings = [pair for pair in pairs if pair is not None]
        try:
            decided = iter(self.pool.verdicts(strings, timeout_s or self.timeout_s)) if strings else iter(())
        except Exception as err:  # a verifier must never take the caller down
            decided = iter([(0.0, f"sandbox_error:{type(err).__name__}")] * len(strings))
        verdicts = [next(decided) if pair is not None else (0.0, "not_a_string") for pair in pairs]
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
