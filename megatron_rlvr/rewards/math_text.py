"""String side of math verification: find the final answer, normalise it, compare numbers
exactly, and turn LaTeX into sympy's Python-like syntax. No sympy and no eval here: this runs
in the caller's process, so every loop is linear and every recursion depth-bounded."""

from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 1000
MAX_DEPTH = 50


class AnswerError(Exception):
    """A verdict reached before comparison; `reason` is the counted category."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------- extraction
def _matching_brace(text: str, open_at: int) -> int:
    """Index of the brace closing text[open_at] == '{' (escaped \\{ \\} count as text)."""
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2
            continue
        if ch == "{":
            depth += 1
            if depth > MAX_DEPTH:
                raise AnswerError("too_deep")
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise AnswerError("unbalanced_braces")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{…} or \\fbox{…} (also `\\boxed 5`), or None."""
    boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
    if boxed < 0 and fbox < 0:
        return None
    i = boxed + len("\\boxed") if boxed > fbox else fbox + len("\\fbox")
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        return text[i + 1 : _matching_brace(text, i)]
    match = re.match(r"[^\s$]+", text[i:])
    return match.group(0) if match else None


_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str:
    """The final answer of a response: the last \\boxed{}, else "the answer is …" (or
    "#### …"), else the last number. Raises AnswerError("no_answer") when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    tail = None
    for match in _ANSWER_IS.finditer(text):
        tail = text[match.end() :]
    hashes = text.rfind("####")
    if hashes >= 0:
        tail = text[hashes + 4 :]
    if tail is not None:
        line = tail.strip().split("\n", 1)[0]
        line = re.split(r"\.\s", line, maxsplit=1)[0].strip()
        if line:
            return line
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        raise AnswerError("no_answer")
    return last.group(0)


# ----------------------------------------------------------------------------- normalisation
_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "$", "~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_UNIT_WORDS = re.compile(r"^(-?[\d.,/]*\d)\s+(?:[a-zA-Z]{2,}(?:\^\{?\d\}?)?\s*){1,3}$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_LHS = re.compile(r"^\s*[a-zA-Z](?:_\{?\w+\}?)?\s*(?:=|\\in)\s*")


def normalize(answer: str) -> str:
    """Canonical string form: LaTeX sugar, units, percent, degrees and separators removed."""
    s = answer.strip()
    if len(s) > MAX_ANSWER_CHARS:
        raise AnswerError("too_long")
    for open_, close in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(open_) and s.endswith(close):
            s = s[2:-2]
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(MAX_DEPTH):
        s, n = _TEXT_COMMANDS.subn(r"\1", s)
        if not n:
            break
    s = _DEGREES.sub("", s).replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    s = _LHS.sub("", s, count=1) if s.count("=") <= 1 else s
    s = _UNIT_WORDS.sub(r"\1", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    choice = re.fullmatch(r"\(([A-Ea-e])\)", s)
    if choice:
        s = choice.group(1)
    return " ".join(s.split())


def compact(s: str) -> str:
    """Whitespace-free, case-folded key for exact string comparison."""
    return re.sub(r"\s+", "", s).lower()


_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$|^(-?)\\frac(\d)(\d)$")
_PLAIN = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?$")


def parse_number(s: str) -> Fraction | None:
    """An exact rational for plain numbers, a/b and \\frac{a}{b}; None for anything else."""
    s = s.replace(" ", "")
    try:
        if _PLAIN.match(s):
            return Fraction(s)
        if re.fullmatch(r"-?\d+/-?\d+", s):
            num, den = s.split("/")
            return Fraction(int(num), int(den))
        frac = _FRAC.match(s)
        if frac:
            sign = frac.group(1) or frac.group(4)
            num, den = (frac.group(2), frac.group(3)) if frac.group(2) else frac.group(5, 6)
            value = Fraction(int(num), int(den))
            return -value if sign else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


# ----------------------------------------------------------------------------- LaTeX → expression
_NAMED = {
    "pi": "pi", "infty": "oo", "infinity": "oo", "cdot": "*", "times": "*", "div": "/",
    "ln": "log", "log": "log", "exp": "exp", "sin": "sin", "cos": "cos", "tan": "tan",
    "cot": "cot", "sec": "sec", "csc": "csc", "arcsin": "asin", "arccos": "acos",
    "arctan": "atan", "alpha": "alpha", "beta": "beta", "gamma": "gamma", "theta": "theta",
    "phi": "phi", "lambda": "lamda", "mu": "mu", "sigma": "sigma", "omega": "omega",
}


def _group(s: str, i: int) -> tuple[str, int]:
    """The argument of a command at s[i]: a {…} group or one character. → (text, next i)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise AnswerError("parse_error")
    if s[i] == "{":
        end = _matching_brace(s, i)
        return s[i + 1 : end], end + 1
    if s[i] == "\\":
        match = re.match(r"\\[a-zA-Z]+", s[i:])
        if match:
            return match.group(0), i + len(match.group(0))
    return s[i], i + 1


_CONSTANT_LETTER = re.compile(r"(?<![A-Za-z])([ei])(?![A-Za-z])")


def latex_to_expr(s: str, depth: int = 0) -> str:
    """LaTeX math (one expression, no top-level commas) → sympy parse_expr syntax. A lone
    `e` is Euler's number and a lone `i` the imaginary unit, as in competition answers."""
    return _CONSTANT_LETTER.sub(lambda m: " E " if m.group(1) == "e" else " I ", _convert(s, depth))


def _convert(s: str, depth: int) -> str:
    if depth > MAX_DEPTH:
        raise AnswerError("too_deep")
    out: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch == "\\":
            match = re.match(r"\\([a-zA-Z]+)", s[i:])
            if not match:
                raise AnswerError("parse_error")
            name = match.group(1)
            i += len(match.group(0))
            if name == "frac":
                num, i = _group(s, i)
                den, i = _group(s, i)
                out.append(f"(({_convert(num, depth + 1)})/({_convert(den, depth + 1)}))")
            elif name == "sqrt":
                index = None
                if i < len(s) and s[i] == "[":
                    close = s.find("]", i)
                    if close < 0:
                        raise AnswerError("parse_error")
                    index, i = s[i + 1 : close], close + 1
                arg, i = _group(s, i)
                inner = _convert(arg, depth + 1)
                out.append(
                    f"sqrt({inner})" if index is None
                    else f"root({inner},{_convert(index, depth + 1)})"
                )
            elif name in _NAMED:
                out.append(f" {_NAMED[name]} ")
            else:
                raise AnswerError("unsupported_latex")
        elif ch == "{":
            end = _matching_brace(s, i)
            out.append(f"({_convert(s[i + 1 : end], depth + 1)})")
            i = end + 1
        elif ch == "^":
            out.append("**")
            i += 1
        elif ch == "}":
            raise AnswerError("unbalanced_braces")
        else:
            out.append(ch)
            i += 1
    return "".join(out)


# ----------------------------------------------------------------------------- structure
def split_top_level(s: str, sep: str = ",") -> list[str]:
    """Splits at `sep` outside (), [] and {} (escaped braces included)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        ch = s[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def structure(s: str, depth: int = 0):
    """Parses an answer's shape: ("union", parts) | ("set", items) | ("interval", lo, hi,
    left_open, right_open) | ("tuple", items) | ("list", items) | ("expr", text)."""
    if depth > MAX_DEPTH:
        raise AnswerError("too_deep")
    s = s.strip()
    union = split_top_level(s, "\\cup")
    if len(union) > 1:
        return ("union", [structure(p, depth + 1) for p in union])
    if s.startswith("\\{") and s.endswith("\\}"):
        return ("set", [structure(p, depth + 1) for p in split_top_level(s[2:-2]) if p])
    items = split_top_level(s)
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and len(split_top_level(s[1:-1])) > 1:
        inner = split_top_level(s[1:-1])
        if len(inner) == 2 and (s[0] == "[" or s[-1] == "]"):
            return ("interval", inner[0], inner[1], s[0] == "(", s[-1] == ")")
        return ("tuple", [structure(p, depth + 1) for p in inner])
    if len(items) > 1:
        return ("list", [structure(p, depth + 1) for p in items])
    return ("expr", s)
