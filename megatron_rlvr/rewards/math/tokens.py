"""A cleaned answer (math.latex.clean) → tokens for math.parse: numbers, letters (with
their subscripts), functions, operators, words, environments. A number literal is one token,
exponent included: `3e2` is 300, so no symbol ever comes out of a literal."""

from __future__ import annotations

import re
from fractions import Fraction

from megatron_rlvr.rewards.math.text import AnswerError, matching_brace

MAX_DECIMAL_EXPONENT = 1000
CONSTANT_NAMES = {"pi", "infty", "infinity", "emptyset", "varnothing", "reals"}
_GREEK = {
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "varepsilon",
    "zeta",
    "eta",
    "theta",
    "vartheta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "varphi",
    "chi",
    "psi",
    "omega",
    "Gamma",
    "Delta",
    "Theta",
    "Lambda",
    "Xi",
    "Sigma",
    "Phi",
    "Psi",
    "Omega",
}
_FUNCTIONS = {
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "arcsin",
    "arccos",
    "arctan",
    "arccot",
    "sinh",
    "cosh",
    "tanh",
    "log",
    "ln",
    "lg",
    "exp",
    "cis",
    "frac",
    "sqrt",
    "binom",
}
_OPS = {
    "cdot": "*",
    "times": "*",
    "ast": "*",
    "div": "/",
    "le": "<=",
    "leq": "<=",
    "leqslant": "<=",
    "ge": ">=",
    "geq": ">=",
    "geqslant": ">=",
    "lt": "<",
    "gt": ">",
    "ne": "!=",
    "neq": "!=",
    "pm": "pm",
    "mp": "mp",
    "cup": "cup",
    "setminus": "setminus",
    "backslash": "setminus",
    "in": "in",
    "langle": "langle",
    "rangle": "rangle",
    "lvert": "|",
    "rvert": "|",
    "vert": "|",
    "mid": "|",
    "lfloor": "lfloor",
    "rfloor": "rfloor",
    "lceil": "lceil",
    "rceil": "rceil",
}
_DECORATIONS = {"vec", "overrightarrow", "overline", "hat", "widehat", "bar", "tilde", "widetilde", "dot"}
_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_COMMAND = re.compile(r"\\([a-zA-Z]+|[{}|\\])")
_PLAIN_FUNCTION = re.compile(
    r"(arcsin|arccos|arctan|sinh|cosh|tanh|sin|cos|tan|cot|sec|csc|log|ln|lg|exp|sqrt|cis|pi)(?![a-zA-Z])"
)


def _subscript(s: str, i: int) -> tuple[str, int]:
    """The raw subscript at s[i] == '_' → (text, next index)."""
    i += 1
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] == "{":
        end = matching_brace(s, i)
        return s[i + 1 : end].replace(" ", ""), end + 1
    command = _COMMAND.match(s, i)
    if command:
        return command.group(0), command.end()
    if i < len(s):
        return s[i], i + 1
    raise AnswerError("parse_error")


def tokenize(s: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch == " ":
            i += 1
        elif ch.isdigit() or (ch == "." and s[i + 1 : i + 2].isdigit()):
            match = _NUMBER.match(s, i)
            assert match is not None, "a digit, or a dot before one, starts a number"
            tokens.append(("num", match.group(0)))
            i = match.end()
            if s.startswith("_", i):  # 1011_2: a numeral in another base, kept as written
                sub, i = _subscript(s, i)
                tokens[-1] = ("id", f"{match.group(0)}_{sub}")
        elif ch.isalpha():
            plain = _PLAIN_FUNCTION.match(s, i)
            if plain:
                name = plain.group(1)
                tokens.append(("const", "pi") if name == "pi" else ("fn", name))
                i = plain.end()
            else:
                tokens.append(("id", ch))
                i += 1
            if s.startswith("_", i) and tokens[-1][0] == "id":
                sub, i = _subscript(s, i)
                tokens[-1] = ("id", f"{ch}_{sub}")
            elif s.startswith("_", i) and tokens[-1][0] == "fn":
                sub, i = _subscript(s, i)
                tokens.append(("base", sub))
        elif ch == "\\":
            i = _command(s, i, tokens)
        elif s.startswith(("<=", ">=", "!="), i):
            tokens.append(("op", s[i : i + 2]))
            i += 2
        elif ch in "+-*/^!,;=<>()[]{}|&'_:":
            tokens.append(("op", ch))
            i += 1
        else:
            raise AnswerError("parse_error")
    return tokens


def _command(s: str, i: int, tokens: list) -> int:
    match = _COMMAND.match(s, i)
    if not match:
        raise AnswerError("parse_error")
    name, i = match.group(1), match.end()
    if name in ("{", "}"):
        tokens.append(("op", "\\" + name))
    elif name in ("\\", "cr"):
        tokens.append(("op", "\\\\"))
    elif name == "|":
        raise AnswerError("unsupported_latex")
    elif name == "TXT":
        end = matching_brace(s, i)
        words = s[i + 1 : end].strip()
        tokens.append(("op", words.lower()) if words.lower() in ("or", "and") else ("text", words))
        i = end + 1
    elif name == "numeral" and s.startswith("{", i):  # math.forms: \numeral{2A}{16}
        end = matching_brace(s, i)
        base_at = end + 1
        base_end = matching_brace(s, base_at) if s.startswith("{", base_at) else -1
        if base_end < 0:
            raise AnswerError("parse_error")
        tokens.append(("id", f"{s[i + 1 : end]}_{s[base_at + 1 : base_end]}"))
        i = base_end + 1
    elif name in ("begin", "end"):
        end = matching_brace(s, i)
        env = s[i + 1 : end].strip().rstrip("*")
        tokens.append((name, env))
        i = end + 1
        if name == "begin" and env == "array" and s.startswith("{", i):
            i = matching_brace(s, i) + 1  # the column spec
    elif name in ("overline", "dot") and tokens and tokens[-1][0] == "num" and s.startswith("{", i):
        end = matching_brace(s, i)
        digits = s[i + 1 : end].strip()
        if not digits.isdigit() or "(" in tokens[-1][1]:
            raise AnswerError("parse_error")
        tokens[-1] = ("num", tokens[-1][1] + f"({digits})")
        i = end + 1
    elif name in ("overline", "dot") and tokens and tokens[-1][0] == "num" and s[i : i + 1].isdigit():
        tokens[-1] = ("num", tokens[-1][1] + f"({s[i]})")
        i += 1
    elif name in _OPS:
        tokens.append(("op", _OPS[name]))
    elif name in CONSTANT_NAMES:
        tokens.append(("const", name))
    elif name == "deg" or name == "pct":
        tokens.append((name, name))
    elif name in _FUNCTIONS:
        tokens.append(("fn", name))
        if s.startswith("_", i):
            sub, i = _subscript(s, i)
            tokens.append(("base", sub))
    elif name in _DECORATIONS:  # \vec{v}, \overline{AB}: a name
        if s.startswith("{", i):
            end = matching_brace(s, i)
            inner, i = s[i + 1 : end].replace(" ", ""), end + 1
        else:
            inner, i = s[i : i + 1], i + 1
        tokens.append(("id", f"{name}{{{inner}}}"))
    elif name in _GREEK:
        name = {"varepsilon": "epsilon", "vartheta": "theta", "varphi": "phi"}.get(name, name)
        if s.startswith("_", i):
            sub, i = _subscript(s, i)
            name = f"{name}_{sub}"
        tokens.append(("id", name))
    else:
        raise AnswerError("unsupported_latex")
    return i


def parse_number(text: str) -> Fraction:
    """A number token → its exact value ('0.1(6)' is 0.1666…)."""
    repeating = None
    if text.endswith(")"):
        text, repeating = text[:-1].split("(")
    mantissa, _, exponent = text.lower().partition("e")
    if exponent and abs(int(exponent)) > MAX_DECIMAL_EXPONENT:
        raise AnswerError("too_large")
    value = Fraction(mantissa if not mantissa.endswith(".") else mantissa[:-1])
    if repeating:
        places = len(mantissa.partition(".")[2])
        value += Fraction(int(repeating), 10**places * (10 ** len(repeating) - 1))
    return value * Fraction(10) ** int(exponent) if exponent else value
