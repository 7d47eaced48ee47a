"""The verdict on one (response, gold) pair as far as exact numbers, canonical forms and
sampled values settle it: find the final answer (math_text), clean it (math_latex), read what it
commits to (math_answer), refuse a different unit (math_units), parse it (math_parse) and
compare (math_compare, math_eval). What these leave undecided goes to sympy (math_sympy). Runs
inside the sandbox workers (rewards/sandbox.py), under their per-pair deadline."""

from __future__ import annotations

from megatron_rlvr.rewards.math_answer import after_label, drop_approximations, foreign_number
from megatron_rlvr.rewards.math_compare import FastBackend, compare
from megatron_rlvr.rewards.math_eval import rational
from megatron_rlvr.rewards.math_latex import clean
from megatron_rlvr.rewards.math_parse import parse_answer, text_node
from megatron_rlvr.rewards.math_text import AnswerError, extract_answers, gold_answer
from megatron_rlvr.rewards.math_tokens import tokenize
from megatron_rlvr.rewards.math_units import signature
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
        gold_raw, answers = gold_answer(gold), extract_answers(response)
        gold_clean = clean(gold_raw)
        pred_clean = ", ".join(drop_approximations(clean(answer)) for answer in answers)
        if not pred_clean.strip(", "):
            return 0.0, "no_answer"
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
