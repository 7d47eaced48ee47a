"""The math verifier on labelled cases (tests/data/math_cases*.jsonl), hostile inputs, random
garbage, and its sandbox; plus the pieces that decide where an answer is and what it says."""

import json
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_rlvr.rewards import VERIFIERS
from megatron_rlvr.rewards.math.answer import after_label, drop_approximations, foreign_number
from megatron_rlvr.rewards.math.latex import clean
from megatron_rlvr.rewards.math.parse import parse_answer
from megatron_rlvr.rewards.math.text import AnswerError, box_at, box_starts, extract_answers
from megatron_rlvr.rewards.math.units import signature
from megatron_rlvr.rewards.math.verdict import prepare
from megatron_rlvr.rewards.math.verifier import MathVerifier, verify_math, verify_math_batch, verify_math_detailed

DATA = Path(__file__).parent / "data"
CASES = [json.loads(line) for path in sorted(DATA.glob("math_cases*.jsonl")) for line in path.open()]
FAMILY_CASES = [json.loads(line) for line in (DATA / "math_cases_families.jsonl").open()]
TIMEOUT = 2.0
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=TIMEOUT, num_workers=2) as v:
        yield v


def test_the_labelled_set_covers_every_family_both_ways():
    assert len(FAMILY_CASES) >= 400
    labels = defaultdict(set)
    for case in FAMILY_CASES:
        labels[case["tag"]].add(case["label"])
    one_sided = {tag for tag, seen in labels.items() if seen != {0, 1} and tag != "adversarial"}
    assert not one_sided, one_sided
    assert len(labels) >= 25


def test_every_labelled_case(verifier):
    verdicts = verifier.verify_batch([c["response"] for c in CASES], [c["gold"] for c in CASES])
    wrong = [(c["tag"], c["response"][-60:], c["gold"][:60], v) for c, v in zip(CASES, verdicts) if v[0] != c["label"]]
    assert not wrong, wrong
    assert all(v[0] in (0.0, 1.0) and isinstance(v[1], str) and v[1] for v in verdicts)


def _rewrite(case: dict, kind: int) -> tuple[str, str] | None:
    """A rewrite that no grader would score differently: spacing, \\displaystyle, an extra brace
    group, \\dfrac, a full stop, the unicode minus; the gold in $…$ or \\boxed{}."""
    response, gold = case["response"], case["gold"]
    if kind >= 6:
        return (response, ("${}$" if kind == 6 else "\\boxed{{{}}}").format(gold)) if "$" not in gold else None
    boxes = box_starts(response)
    try:
        content, end = box_at(response, boxes[0]) if boxes else ("", -1)
    except AnswerError:  # a box the token limit cut off has nothing to rewrite
        return None
    if not boxes:
        return None
    new = [
        f" {content} ",
        f"\\displaystyle {content}",
        f"{{{content}}}",
        content.replace("\\frac", "\\dfrac"),
        f"{content}.",
        content.replace("-", "\u2212"),
    ][kind]
    return response[: boxes[0]] + "\\boxed{" + new + "}" + response[end:], gold


def test_harmless_rewrites_keep_every_verdict(verifier):
    plain = [c for c in CASES if c["tag"] != "adversarial"]
    rewritten = [(_rewrite(c, i % 8), c) for i, c in enumerate(plain)]
    rewritten = [(pair, c) for pair, c in rewritten if pair is not None]
    assert len(rewritten) > 800
    verdicts = verifier.verify_batch([p[0] for p, _ in rewritten], [p[1] for p, _ in rewritten])
    changed = [(p, v) for (p, c), v in zip(rewritten, verdicts) if v[0] != c["label"]]
    assert not changed, changed


@pytest.mark.parametrize(
    "case", [c for c in CASES if c["tag"] == "adversarial"], ids=lambda c: repr(c["response"][:30])
)
def test_hostile_inputs_return_zero_within_the_timeout(verifier, case):
    # the whole verdict runs in a killable worker: a response the reading could not finish in
    # time would come back as "timeout"; a hostile one is read and refused on its merits
    reward, reason = verifier.verify(case["response"], case["gold"])
    assert reward == 0.0 and reason and reason != "timeout", reason


def test_megabyte_and_backtracking_bait_responses_are_read_in_time(verifier):
    # every pattern that reads a response must be linear: bait the worker could not read within
    # the timeout would come back as "timeout" (tests/test_math_bounded.py times each pattern)
    assert verifier.verify("x" * 1_000_000 + " so the answer is \\boxed{12}", "12") == (1.0, "exact")
    for bait in (
        "(" * 500_000 + "$" * 500_000,
        "\\boxed{" * 200_000,
        "answer" + " " * 300_000 + "x",
        "\\(" * 200_000,
        "the answer is 5" + " " * 3_000 + "x",
        "the roots of " + "a" * 500_000 + " are",
    ):
        reward, reason = verifier.verify(bait, "12")
        assert reward == 0.0 and reason != "timeout", (bait[:20], reason)


def test_runaway_sympy_is_killed_and_the_pool_recovers(verifier):
    # exact numbers are no help and doubles overflow, so sympy must evaluate sin of a number
    # with ~10^8 digits: minutes, unless the worker is killed
    reward, reason = verifier.verify("\\boxed{\\sin(e^{e^{e^{3}}})}", "0", timeout_s=0.5)
    assert reward == 0.0 and reason == "timeout"  # killed at its bound, not finished
    assert verifier.verify("\\boxed{\\tan^{6} x}", "\\sec^6 x - 3\\sec^4 x + 3\\sec^2 x - 1") == (1.0, "sympy_equal")


def test_sandbox_never_executes_answer_code(verifier, tmp_path):
    marker = tmp_path / "pwned"
    for attack in (
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        "\\boxed{exec}",
        f"The answer is eval(\"open('{marker}', 'w')\")",
    ):
        assert verifier.verify(attack, "0")[0] == 0.0
    assert not marker.exists()


def test_random_garbage_never_raises_and_never_hangs():
    pieces = [
        "\\frac",
        "\\sqrt",
        "{",
        "}",
        "(",
        ")",
        "[",
        "]",
        "^",
        "_",
        "\\boxed{",
        "1",
        "x",
        "e",
        "2e3",
        ",",
        "\\pm",
        "=",
        "<",
        "\\le",
        "|",
        "\\{",
        "\\}",
        "\\text{ or }",
        "\\%",
        "^\\circ",
        "\\begin{pmatrix}",
        "&",
        "\\\\",
        "\\end{pmatrix}",
        "\\infty",
        "\\cup",
        "!",
        "\\log_",
        "\\sin",
        "-",
        ".",
        "\\overline{3}",
        " ",
        "\u221a",
        "\u00b2",
        "\\left(",
        "\\right.",
        "\\TXT{",
        "\\cr",
        "0.",
        "\\binom",
    ]
    rng = random.Random(0)
    start = time.process_time()  # this process's CPU time: other jobs on the machine do not inflate it
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        verdict = prepare(f"\\boxed{{{text}}}", rng.choice(["1", "x^2", "(1,2)", "[0,1)", text]))
        assert len(verdict) == 2 and isinstance(verdict[0], (float, str)), (text, verdict)
    assert time.process_time() - start < 30


def test_reasons_are_counted(verifier):
    before = verifier.stats.copy()
    verifier.verify_batch(
        ["\\boxed{1}", "no number here", "\\boxed{9^{9^{9^9}}}", "\\boxed{3} or \\boxed{4}"], ["1", "1", "1", "3"]
    )
    delta = verifier.stats - before
    assert delta == Counter({"exact": 1, "no_answer": 1, "too_large": 1, "hedged": 1})
    # cut off by the token limit: inside <think>, mid-sentence, inside the box, after "the answer is"
    cut = [
        "<think>\nSo far 3 + 4 = 7, then",
        "First, 3 + 4 = 7. " * 8 + "Then we multiply the result by",
        "Adding up, 3 + 4 = 7, so \\boxed{\\frac{7}{",
        "We get 3 + 4 = 7. Therefore, the final answer is",
    ]
    assert verifier.verify_batch(cut, ["7"] * 4) == [(0.0, "no_final_answer")] * 4
    assert verifier.stats["no_final_answer"] - before["no_final_answer"] == 4


def test_function_api_and_registry():
    assert verify_math("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert verify_math("\\boxed{3}", "4") == 0.0
    assert verify_math_detailed("\\boxed{x^2-1}", "(x-1)(x+1)") == (1.0, "sympy_equal")
    assert verify_math_batch(["\\boxed{2}", "\\boxed{5}"], ["2", "3"]) == [(1.0, "exact"), (0.0, "numeric_mismatch")]
    assert VERIFIERS["math"] is verify_math_batch
    assert verify_math(None, "1") == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "response, answers",
    [
        ("a \\boxed{1} b \\boxed{\\frac{2}{3}} c", ["\\frac{2}{3}"]),
        ("The roots are $x = \\boxed{3}$ and $x = \\boxed{-4}$.", ["3", "-4"]),
        ("It is $\\boxed{7}$. Alternatively, counting endpoints, it is $\\boxed{9}$.", ["7", "9"]),
        ("It is $\\boxed{7}$. Wait, I made a mistake: it is actually $\\boxed{9}$.", ["9"]),
        ("<think>maybe \\boxed{5}</think>\nThe answer is 6.", ["6"]),
        ("The answer is 12. Done.", ["12"]),
        ("Final Answer: The final answer is $3.5$. I hope it is correct.", ["3.5"]),
        ("The solutions are $x=1$ and $x=5$.", ["x=1", "x=5"]),
        ("She pays $3 each.\n#### 1,234", ["1,234"]),
        ("x=1 then y = -3.5 in the end", ["-3.5"]),
        ("so we get $x = \\frac{1}{2}$", ["x = \\frac{1}{2}"]),
        ("\\boxed{\\boxed{4}}", ["4"]),
        ("She pays $\\$9$ a day.\nThe answer is $\\$18$.", ["\\$18"]),
    ],
)
def test_where_the_final_answer_is(response, answers):
    assert extract_answers(response) == answers


@pytest.mark.parametrize(
    "answer, cleaned",
    [
        ("\\$1{,}234.50", "1234.50"),
        ("1\\,000\\,000", "1000000"),
        ("\\left( 1, 2 \\right)", "( 1, 2 )"),
        ("x = \\dfrac{1}{2}", "x = \\frac{1}{2}"),
        ("{3 \\over 4}", "\\frac{3 }{ 4}"),
        ("12\\text{ m}^2", "12 \\TXT{m} ^2"),
        ("\u22125 \u00d7 \u221a3", "-5 \\times \\sqrt{3}"),
        ("45^{\\circ}", "45 \\deg"),
        ("]-\\infty; 3[", "(-\\infty, 3)"),
        ("(1, 2) U [3, 4]", "(1, 2) \\cup [3, 4]"),
        ("{}_5C_2", "\\binom{5}{2}"),
        ("C(7, 3)", "\\binom{7}{3}"),
        ("\\hat{\\imath} - 2\\mathbf{k}", "\\hat{i} - 2 \\hat{k}"),
        ("4.8\\text{E-}19", "4.8e-19"),
        ("2a_{16}", "\\numeral{2A}{16}"),
        ("(1011)_{\\text{two}}", "\\numeral{1011}{2}"),
        ("f'(x) = 2x", "f_{p1}(x) = 2x"),
        ("5'6\"", "66 \\TXT{in}"),
        ("3\u221a(2) + \u00bd", "3\\sqrt(2) + \\frac{1}{2}"),
        ("25^\\circ \\mathrm{C}", "25 \\TXT{degC}"),
        ("250\\,\\mu\\text{m}", "250 \\TXT{\\mu m}"),
        ("9.8 \\mathrm{~m/s^2}", "9.8 \\TXT{m/s^2}"),
    ],
)
def test_cleaning(answer, cleaned):
    assert clean(answer) == cleaned


def test_a_number_literal_never_makes_a_symbol():
    assert parse_answer("3e2") == ("num", 300)
    assert parse_answer("2.5E-1") == ("num", 0.25)
    assert parse_answer("4e-x")[0] == "add"  # 4e − x: no digits after e, so Euler's number
    assert parse_answer(clean("2\\frac{1}{2}")) == ("num", 2.5)
    assert parse_answer(clean("2\\frac{\\pi}{2}"))[0] == "mul"
    assert verify_math("\\boxed{3e2}", "6e") == 0.0


def test_the_command_line_tool_shows_the_verdict_and_reason(tmp_path):
    tool = [sys.executable, str(REPO / "tools" / "verify_math.py")]
    out = subprocess.run(
        tool + ["The answer is \\boxed{1\\frac{3}{4}}.", "7/4"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.split() == ["1.0", "numeric_equal"], out
    (tmp_path / "response.txt").write_text("so x > -1, that is \\boxed{[-1, \\infty)}")
    out = subprocess.run(
        tool + ["--response-file", str(tmp_path / "response.txt"), "x > -1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and out.stdout.split() == ["0.0", "shape_mismatch"], out


def test_batch_length_mismatch_is_a_caller_error(verifier):
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        verifier.verify_batch(["1", "2"], ["1"])


def test_a_sandbox_that_cannot_start_fails_fast_instead_of_hanging():
    # 16 MiB of address space is too little for Python to start: every worker dies at once
    with MathVerifier(timeout_s=1.0, num_workers=1, memory_mb=16) as broken:
        verdicts = broken.verify_batch(
            ["\\boxed{\\tan^6 x}", "\\boxed{3}"], ["\\sec^6 x - 3\\sec^4 x + 3\\sec^2 x - 1", "3"]
        )
    assert verdicts == [(0.0, "sandbox_unavailable")] * 2  # every verdict is the sandbox's


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("12 \\mathrm{~J}", "12 \\text{ joules}", True),
        ("12 \\mathrm{~J}", "12\\ \\mathrm{kJ}", False),
        ("7 \\text{ mJ}", "7 \\text{ MJ}", False),
        ("250 \\mathrm{~nm}", "250 \\mathrm{~\\mu m}", False),
        ("4 \\text{ cm}^2", "4 \\text{ square centimeters}", True),
        ("4 \\text{ cm}^2", "4 \\text{ cm}", False),
        ("9.8 \\mathrm{~m/s^2}", "9.8 \\text{ meters per second squared}", True),
        ("9.8 \\mathrm{~m/s^2}", "9.8 \\mathrm{~m} \\mathrm{~s}^{-1}", False),
        ("60 \\text{ mph}", "60 \\text{ miles per hour}", True),
        ("60 \\text{ mph}", "60 \\text{ km/h}", False),
        ("25^\\circ \\mathrm{C}", "25 \\text{ K}", False),
        ("\\$12", "12 \\text{ dollars}", True),
        ("\\$12", "12 \\text{ cents}", False),
        ("1 \\text{ KM}", "1 \\text{ km}", True),
        ("5 \\text{ hours in total}", "5 \\text{ h}", True),
    ],
)
def test_units_are_read_by_prefix_name_and_power(a, b, same):
    assert (signature(clean(a), a) == signature(clean(b), b)) is same
    assert signature(clean(a), a) and signature(clean(b), b)


def test_words_that_are_not_units_name_none():
    for answer in ("48 \\text{ cookies}", "5 \\text{ in total}", "24 \\text{ square units}", "12", "x \\text{ or } y"):
        assert not signature(clean(answer), answer), answer


@pytest.mark.parametrize(
    "answer, kept",
    [
        ("2\\sqrt{2} \\approx 2.83", "2\\sqrt{2}"),
        ("x = \\sqrt{3} \\approx 1.73 \\TXT{cm}", "x = \\sqrt{3}"),
        ("\\approx 1.41", "1.41"),
        ("x \\approx 1.41", "1.41"),
        ("\\sqrt{2} \\approx 1.41, -\\sqrt{2} \\approx -1.41", "\\sqrt{2}, -\\sqrt{2}"),
        ("\\{\\sqrt{2} \\approx 1.41\\}", "\\{\\sqrt{2} \\approx 1.41\\}"),
    ],
)
def test_an_approximation_after_an_exact_value_is_dropped(answer, kept):
    assert drop_approximations(answer).strip() == kept


def test_labels_and_decimal_commas():
    assert after_label("\\det A = -2") == "-2"
    assert after_label("\\gcd(12, 18) = 6") == "6"
    assert after_label("\\det A = 5, \\det B = 6") is None  # two answers, not a label
    assert after_label("x \\le 3") is None and after_label("= 4") is None
    half, whole = Fraction(7, 2), Fraction(3500)
    assert foreign_number("1.234,5", None) == "1234.5" and foreign_number("1.234.567", None) == "1234567"
    assert foreign_number("3,5", half) == foreign_number("3{,}5", half) == "3.5"
    assert foreign_number("3,5", None) == "3,5"  # two roots, against a list gold
    assert foreign_number("3,500", half) == "3,500"  # thousands, as in English
    assert foreign_number("1,23,456", whole) == "123456" and foreign_number("1,23,456", None) == "1,23,456"


def test_a_set_builder_is_its_condition():
    assert parse_answer(clean("\\{x \\mid x > 2\\}")) == parse_answer("x > 2")
    assert parse_answer(clean("\\{x \\in \\mathbb{R} : x < 0 \\text{ or } x > 1\\}"))[0] == "list"
    with pytest.raises(AnswerError):
        parse_answer(clean("\\{x \\in \\mathbb{Z} \\mid x > 2\\}"))


def test_a_dropped_label_reaches_the_sandbox_as_read(verifier):
    gold = "\\sec^6 x - 3\\sec^4 x + 3\\sec^2 x - 1"
    assert verifier.verify("\\boxed{\\det M = \\tan^{6} x}", gold) == (1.0, "sympy_equal")
    assert verifier.verify("\\boxed{\\det M = \\tan^{4} x}", gold)[0] == 0.0
