"""What a cleaned answer commits to, when it says more than its value:

- an exact value then an approximation (`2\\sqrt{2} \\approx 2.83`, `x = \\sqrt3 \\approx 1.73`) is
  the exact value; an approximation alone (`\\approx 1.41`, `x \\approx 1.41`) is its number, so
  it equals only a gold that is that decimal;
- a label the parser cannot read (`\\det A = -2`, `\\angle ABC = 30^\\circ`, `\\gcd(12, 18) = 6`) is
  dropped: the answer is what follows the last `=` (labels it can read, `P(A) = 0.3`, `f(2) = 5`,
  are the last member of an equation chain in math.compare);
- a number in another convention: `1.234,5` (dots grouping thousands, then a decimal comma) is
  always 1234.5, and `1.234.567` (two dot groups or more) 1234567; a decimal comma alone, `3,5`
  or `3{,}5`, is 3.5 only against a gold that is one non-integer number, and never when three
  digits follow the comma (`3,500` is three thousand five hundred, as in English); the Indian
  grouping `1,23,456` is 123456 only against a gold that is one number (else it is a list).

Each is a scan of the answer at bracket depth 0, linear in its length."""

from __future__ import annotations

import re
from fractions import Fraction

from megatron_rlvr.rewards.math.text import matching_brace

_APPROX = r"\approx"
_SEPARATOR = re.compile(r",|;|\\TXT\{(?:or|and)\}")
_NAME = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?")
_EUROPEAN = re.compile(r"-?\d{1,3}(?:\.\d{3})+,\d+|-?\d{1,3}(?:\.\d{3}){2,}")
_DECIMAL_COMMA = re.compile(r"(?<!\d)-?\d+(?:,|\{,\})(?:\d{1,2}|\d{4,})")
_INDIAN = re.compile(r"-?\d{1,2}(?:,\d{2})+,\d{3}(?:\.\d+)?")


def unwrap(answer: str) -> str:
    """The answer without brace groups around all of it (`{\\det A = -2}`), as the parser reads it."""
    answer = answer.strip()
    for _ in range(3):
        if not (answer.startswith("{") and matching_brace(answer, 0) == len(answer) - 1):
            break
        answer = answer[1:-1].strip()
    return answer


def _top_level(text: str) -> list[bool]:
    """For each character: whether it is outside every (), [] and {} group."""
    depth, outside = 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        outside.append(depth == 0)
        if ch in ")]}":
            depth = max(0, depth - 1)
    return outside


def _segments(text: str) -> list[tuple[int, int]]:
    """(start, end) of the parts of an answer between its top-level separators."""
    outside = _top_level(text)
    cuts = [m for m in _SEPARATOR.finditer(text) if outside[m.start()]]
    starts = [0] + [m.end() for m in cuts]
    ends = [m.start() for m in cuts] + [len(text)]
    return list(zip(starts, ends))


def drop_approximations(answer: str) -> str:
    """Each part `exact \\approx decimal` → `exact`; `\\approx decimal` → `decimal`."""
    if _APPROX not in answer:
        return answer
    answer = unwrap(answer)
    pieces, at = [], 0
    for start, end in _segments(answer):
        part = answer[start:end]
        cut = part.find(_APPROX)
        if cut < 0 or not _top_level(part)[cut]:
            continue
        exact = part[:cut].strip()
        approx = part[cut + len(_APPROX) :]
        kept = approx if not exact or _NAME.fullmatch(exact) else part[:cut].rstrip()
        if _APPROX in kept:  # \approx 1.41 \approx 1.4: the first number stands
            kept = kept[: kept.find(_APPROX)]
        pieces += [answer[at:start], kept]
        at = end
    return "".join(pieces) + answer[at:]


def after_label(answer: str) -> str | None:
    """What follows the last top-level `=` of a one-part answer, or None when there is none."""
    answer = unwrap(answer)
    outside = _top_level(answer)
    if any(outside[m.start()] for m in _SEPARATOR.finditer(answer)):
        return None
    equals = [i for i, ch in enumerate(answer) if ch == "=" and outside[i] and answer[i - 1 : i] not in ("<", ">", "!")]
    if not equals or not answer[: equals[-1]].strip():
        return None
    rest = answer[equals[-1] + 1 :].strip()
    return rest or None


def foreign_number(answer: str, gold_value: Fraction | None) -> str:
    """A number written in another convention → as the parser reads numbers (see the module
    docstring); `gold_value` is the gold answer's value when it is one number."""
    answer = unwrap(answer)
    if _EUROPEAN.fullmatch(answer):
        return answer.replace(".", "").replace(",", ".")  # 1.234,5 and 1.234.567
    if gold_value is not None and gold_value.denominator != 1 and _DECIMAL_COMMA.fullmatch(answer):
        return answer.replace("{,}", ".").replace(",", ".")
    if gold_value is not None and _INDIAN.fullmatch(answer):
        return answer.replace(",", "")
    return answer
