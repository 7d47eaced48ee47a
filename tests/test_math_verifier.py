"""The sympy math verifier on labelled cases, adversarial inputs and its sandbox."""

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from megatron_rlvr.rewards import VERIFIERS
from megatron_rlvr.rewards.math import MathVerifier, verify_math, verify_math_batch, verify_math_detailed
from megatron_rlvr.rewards.math_text import compact, extract_answer, normalize

CASES = [json.loads(line) for line in (Path(__file__).parent / "data" / "math_cases.jsonl").open()]
TIMEOUT = 2.0


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=TIMEOUT, num_workers=2) as v:
        yield v


def test_enough_labelled_cases():
    assert len(CASES) >= 150
    tags = Counter(c["tag"] for c in CASES)
    assert tags["adversarial"] >= 20 and sum(c["label"] for c in CASES) < len(CASES)


def test_every_labelled_case(verifier):
    verdicts = verifier.verify_batch([c["response"] for c in CASES], [c["gold"] for c in CASES])
    wrong = [(c["tag"], c["response"][-50:], c["gold"], v) for c, v in zip(CASES, verdicts)
             if v[0] != c["label"]]
    assert not wrong, wrong
    assert all(v[0] in (0.0, 1.0) and isinstance(v[1], str) for v in verdicts)


@pytest.mark.parametrize("case", [c for c in CASES if c["tag"] == "adversarial"],
                         ids=lambda c: repr(c["response"][:30]))
def test_adversarial_inputs_return_zero_within_the_timeout(verifier, case):
    start = time.monotonic()
    reward, reason = verifier.verify(case["response"], case["gold"])
    assert reward == 0.0 and reason
    assert time.monotonic() - start < TIMEOUT + 1.5


def test_runaway_sympy_is_killed_and_the_pool_recovers(verifier):
    # passes the size guards but makes sympy simplify for a very long time
    nasty = "\\boxed{(x+1)^{200}(y+2)^{150} - (y+2)^{150}(x+1)^{200} + (x+y)^{300}}"
    start = time.monotonic()
    reward, reason = verifier.verify(nasty, "x^2", timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert reward == 0.0 and reason == "timeout" and elapsed < 2.0
    assert verifier.verify("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == (1.0, "sympy_equal")


def test_sandbox_never_executes_answer_code(verifier, tmp_path):
    marker = tmp_path / "pwned"
    attack = f"\\boxed{{__import__('os').system('touch {marker}')}}"
    assert verifier.verify(attack, "0")[0] == 0.0
    assert verifier.verify("\\boxed{exec}", "0")[0] == 0.0
    assert not marker.exists()


def test_reasons_are_counted(verifier):
    before = verifier.stats.copy()
    verifier.verify_batch(["\\boxed{1}", "no number here", "\\boxed{9^9^9^9}"], ["1", "1", "1"])
    delta = verifier.stats - before
    assert delta["exact"] == 1 and delta["no_answer"] == 1 and delta["too_large"] == 1


def test_function_api_and_registry():
    assert verify_math("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert verify_math("\\boxed{3}", "4") == 0.0
    assert verify_math_detailed("\\boxed{x^2-1}", "(x-1)(x+1)") == (1.0, "sympy_equal")
    assert verify_math_batch(["\\boxed{2}", "\\boxed{5}"], ["2", "3"]) == [(1.0, "exact"), (0.0, "numeric_mismatch")]
    assert VERIFIERS["math"] is verify_math_batch
    assert verify_math(None, "1") == 0.0  # type: ignore[arg-type]


def test_extraction_and_normalisation_units():
    assert extract_answer("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\frac{2}{3}"
    assert extract_answer("The answer is 12. Done.") == "12"
    assert extract_answer("x=1 then y = -3.5 in the end") == "-3.5"
    assert normalize("\\$1,234.50") == "1234.50"
    assert compact(normalize("\\left( 1, 2 \\right)")) == "(1,2)"
    assert normalize("45^{\\circ}") == "45"
    assert normalize("x = \\dfrac{1}{2}") == "\\frac{1}{2}"


def test_batch_length_mismatch_is_a_caller_error(verifier):
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        verifier.verify_batch(["1", "2"], ["1"])


def test_a_sandbox_that_cannot_start_fails_fast_instead_of_hanging():
    # 16 MiB of address space is too little for Python to start: every worker dies at once
    with MathVerifier(timeout_s=1.0, num_workers=1, memory_mb=16) as broken:
        start = time.monotonic()
        verdicts = broken.verify_batch(["\\boxed{x^2}", "\\boxed{3}"], ["x*x", "3"])
        assert time.monotonic() - start < 30
    assert verdicts == [(0.0, "sandbox_unavailable"), (1.0, "exact")]
