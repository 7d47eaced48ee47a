"""The verdict on one (response, gold) pair as far as exact numbers, canonical forms and
sampled values settle it: find the final answer (math.text), clean it (math.latex), read what it
commits to (math.answer), refuse a different unit (math.units), parse it (math.parse) and
compare (math.compare, math.evaluate). What these leave undecided goes to sympy (math.symbolic). Runs
inside the sandbox workers (rewards/math/workers.py), under their per-pair deadline."""

from __future__ import annotations

import re
from fractions import Fraction

from megatron_rlvr.rewards.math.answer import after_label, drop_approximations, foreign_number
from megatron_rlvr.rewards.math.compare import FastBackend, compare
from megatron_rlvr.rewards.math.evaluate import rational
from megatron_rlvr.rewards.math.latex import clean
from megatron_rlvr.rewards.math.parse import parse_answer, text_node
from megatron_rlvr.rewards.math.text import AnswerError, extract_answers, gold_answer
from megatron_rlvr.rewards.math.tokens import tokenize
from megatron_rlvr.rewards.math.units import signature
from megatron_rlvr.rewards.verdict import Verdict

_FAST = FastBackend()


# an escaped command written with its backslash doubled (`\\frac`, as JSON-escaped text shows it);
# never the row break before a command (`1 \\ \frac12` keeps its break); not the relations, whose
# doubled spelling math-verify leaves unread (its label for `-2 \\le x \\le 7` against an interval)
_DOUBLED = re.compile(
    r"(?<!\\)\\\\(?=(?:boxed|[dt]?frac|left|right|sqrt|pi|cdot|times|infty|text|mathrm|cup|in)(?![a-zA-Z]))"
)
_DOUBLED_RELATION = re.compile(r"(?<!\\)\\\\(?=(?:leq?|geq?|neq?|lt|gt)(?![a-zA-Z]))")
_ONE_LETTER_TEXT = re.compile(r"\\TXT\{([A-Za-z])\}")  # a whole answer \text{e} is the letter e
# the left side of a gold `name = value`: names, subscripts, ratios, |AB|, \frac{NO}{BO}
_NAME_SIDE = re.compile(
    r"(?:[A-Za-z]|\\TXT\{[A-Za-z]+\}|_\{(?:[A-Za-z0-9]|\\TXT\{[A-Za-z]+\})*\}|_[A-Za-z0-9]|[|:{}\s]|\\frac)++"
)
_VARIABLE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z](?![a-zA-Z])")
_GOLD_DECIMAL_COMMA = re.compile(r"(?<!\d)(-?\d+),(\d+)")
_DECIMAL = re.compile(r"(?<!\d)-?\d*\.(\d+)")
LONG_DECIMAL_DIGITS = 10  # a decimal this long is the exact value's expansion, not an estimate


def _one_letter(answer: str) -> str:
    whole = _ONE_LETTER_TEXT.fullmatch(answer)
    return whole.group(1) if whole else answer


def _gold_value(gold_clean: str, pred_clean: str) -> str:
    """What the response is compared with, read from the gold answer where the response gives
    only a value: the value of a labelled gold (`|AB| = 1`, `V_1:V_2 = 11:21`: the label is a
    name, the value holds no variable), and a gold decimal comma after a lone zero (`0,111` is
    0.111; `1,22` stays the list 1, 22) when the response is a decimal number."""
    parts = gold_clean.split("=")
    if len(parts) == 2 and "=" not in pred_clean and _NAME_SIDE.fullmatch(parts[0].strip()):
        value = parts[1].strip()
        if value and not _VARIABLE.search(value):
            return value
    comma = _GOLD_DECIMAL_COMMA.fullmatch(gold_clean)
    if comma and comma.group(1).lstrip("-") == "0" and _DECIMAL.fullmatch(pred_clean):
        return f"{comma.group(1)}.{comma.group(2)}"
    return gold_clean


def _long_decimal(pred_clean: str, gold_tree) -> bool | None:
    """A decimal of LONG_DECIMAL_DIGITS or more places against a rational gold: equal when it
    is within one unit of its last place (0.0833333333333333 for 1/12); None otherwise."""
    decimal = _DECIMAL.fullmatch(pred_clean)
    gold = rational(gold_tree)
    if decimal is None or gold is None or len(decimal.group(1)) < LONG_DECIMAL_DIGITS:
        return None
    return abs(Fraction(pred_clean) - gold) <= Fraction(1, 10 ** len(decimal.group(1)))


def _same_tokens(a: str, b: str) -> bool:
    """Equal up to spacing that does not change meaning (3 : 4 and 3:4, but never 4e-1 and
    4e - 1)."""
    if a == b:
        return True
    try:
        return tokenize(a) == tokenize(b)
    except AnswerError:
        return False


def _read_response(pred_clean: str, gold_tree) -> tuple[str, tuple]:
    """(text, tree) of the response's answer, the text being what the sandbox parses again; a
    label the parser cannot read (`\\det A = -2`) is dropped when the gold answer is not
    itself an equation or inequality."""
    try:
        return pred_clean, parse_answer(pred_clean)
    except AnswerError as err:
        rest = after_label(pred_clean) if gold_tree[0] != "rel" else None
        if err.reason not in ("parse_error", "unsupported_latex") or rest is None:
            raise
        return rest, parse_answer(rest)


def prepare(response: str, gold: str) -> Verdict | tuple[str, str]:
    """A verdict when the in-process checks decide, else the cleaned (pred, gold) for sympy."""
    try:
        if not isinstance(response, str) or not isinstance(gold, str):
            return 0.0, "not_a_string"
        response, gold = _DOUBLED.sub("\\\\", response), _DOUBLED_RELATION.sub("\\\\", _DOUBLED.sub("\\\\", gold))
        gold_raw, answers = gold_answer(gold), extract_answers(response)
        gold_clean = _one_letter(clean(gold_raw))
        pred_clean = ", ".join(drop_approximations(clean(answer)) for answer in answers)
        pred_clean = _one_letter(pred_clean)
        if not pred_clean.strip(", "):
            return 0.0, "no_answer"
        gold_clean = _gold_value(gold_clean, pred_clean)
        if _same_tokens(pred_clean, gold_clean):
            return 1.0, "exact"
        pred_units, gold_units = signature(pred_clean, " ".join(answers)), signature(gold_clean, gold_raw)
        if pred_units and gold_units and pred_units != gold_units:
            return 0.0, "unit_mismatch"  # 12 kJ is not 12 J (a unit on one side only is ignored)
        try:
            gold_tree = parse_answer(gold_clean)
        except AnswerError:  # a gold answer in prose: compare it as words
            equal = text_node(gold_clean) == text_node(pred_clean)
            return (1.0, "text_equal") if equal else (0.0, "gold_unparsed")
        long_decimal = _long_decimal(pred_clean, gold_tree)
        if long_decimal is not None:
            return (1.0, "decimal_expansion") if long_decimal else (0.0, "numeric_mismatch")
        pred_clean, pred_tree = _read_response(foreign_number(pred_clean, rational(gold_tree)), gold_tree)
        equal, reason = compare(pred_tree, gold_tree, _FAST)
        if equal is None:
            return pred_clean, gold_clean
        return (1.0 if equal else 0.0), reason
    except AnswerError as err:
        return 0.0, err.reason
    except RecursionError:
        return 0.0, "too_deep"
    except Exception as err:  # a verifier must never take the caller down
        return 0.0, f"internal_error:{type(err).__name__}"
