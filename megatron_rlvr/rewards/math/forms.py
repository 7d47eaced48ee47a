"""Answer spellings rewritten to the one form the parser reads, as part of math.latex.clean:
French/ISO intervals (`]a,b[`), a letter U between intervals as a union, binomials written
`C(n,k)` or `{}_nC_k`, unit vectors (`3\\mathbf{i} - \\hat{j}`), E-notation in text
(`4.8\\text{E-}19`), primes on a name (`f'(x)`), feet and inch marks (`5'`, `5''`, `5'6"`) and
numerals in another base (`2a_{16}`, `(1011)_2`, `1021_{\\text{three}}`). Each is one regex pass,
linear in the answer's length, and each is anchored on marks that leave no other reading."""

from __future__ import annotations

import re
from fractions import Fraction

# ]a,b[  [a,b[  ]a,b]  (also with ';'): at least one bracket turned outwards is an open end
# (each end is one run of a class that excludes the delimiters, stripped in _iso: no two
# repeats can trade characters, so a failed try costs the run's length once)
_ISO_INTERVAL = re.compile(r"(?<![\w}])([\[\]])([^\[\],;]*)[,;]([^\[\],;]*)([\[\]])(?!\s*\{)")
_LETTER_UNION = re.compile(r"(?<=[)\]])\s*U\s*(?=[(\[])")  # (-oo, 2) U (3, oo)
_BINOM_CALL = re.compile(r"(?<![\w\\])C\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)")  # C(5,2)
_BINOM_SCRIPTS = re.compile(  # {}_5C_2, {}^{8}C_{3}, _5C_2
    r"(?:\{\s*\}\s*|(?<![\w}\\]))[_^]\s*(\{\s*\d+\s*\}|\d)\s*C\s*_\s*(\{\s*\d+\s*\}|\d+)"
)
_UNIT = r"(i|j|k|\\imath|\\jmath)"
_UNIT_VECTOR = re.compile(  # \mathbf{i}, \hat{\imath}, \vec{j}, \hat{\mathbf{k}}, \hat i
    r"\\(?:mathbf|boldsymbol|bm|vec|hat|widehat)\s*(?:\{\s*\\(?:mathbf|boldsymbol|bm)\s*\{\s*"
    + _UNIT
    + r"\s*\}\s*\}|\{\s*"
    + _UNIT
    + r"\s*\}|\s+"
    + _UNIT
    + r"(?![a-zA-Z]))"
)
_TEXT_E = re.compile(  # 4.8\text{E-}19, 1.5\text{E}{-4}, 2\mathrm{e}{+3}
    r"(?<=\d)\s*\\(?:text|mathrm|textnormal)\s*\{\s*[eE]\s*([-+]?)\s*\}\s*(?:\{\s*([-+]?\d+)\s*\}|(\d+))"
)
_PRIME = re.compile(r"(?<![\\a-zA-Z\d])([a-zA-Z])\s*('{1,3}|(?:\^\s*\{?\s*\\prime\s*\}?)+)")  # f'(x), y''
_FEET_INCHES = re.compile(r"(?<![\w.])(\d+)\s*'\s*(\d+(?:\.\d+)?)\s*(?:''|\")")  # 5'6"
_INCHES = re.compile(r"(?<=\d)\s*(?:''|\")")
_FEET = re.compile(r"(?<=\d)\s*'")
_BASE_WORDS = {
    w: n
    for n, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen".split()
    )
}
_BASE_NUMERAL = re.compile(  # 1011_2, 2a_{16}, (10001)_2, 1011_{(2)}, 1021_{\text{three}}
    r"(?<![\w.\\}])(?:\(\s*([0-9A-Za-z]+)\s*\)|(\d[0-9A-Za-z]*))\s*_\s*"
    r"(?:\{\s*(?:\(\s*(\d+)\s*\)|\\(?:text|mathrm|textnormal)\s*\{\s*([a-z]+)\s*\}|(\d+)|([a-z]+))\s*\}|(\d+))"
)


def _iso(match: re.Match) -> str:
    left, lo, hi, right = (g.strip() for g in match.groups())
    if (left == "[" and right == "]") or not lo or not hi:
        return match.group(0)  # an ordinary closed interval, or no interval
    return ("(" if left == "]" else "[") + f"{lo}, {hi}" + (")" if right == "[" else "]")


def _binom(match: re.Match) -> str:
    n, k = (g.strip("{} ") for g in match.groups())
    return rf"\binom{{{n}}}{{{k}}}"


def _unit_vector(match: re.Match) -> str:
    name = next(g for g in match.groups() if g)
    return r" \hat{" + name.lstrip("\\")[0] + "} "


def _prime(match: re.Match) -> str:
    primes = match.group(2).count("'") + match.group(2).count("prime")
    return f"{match.group(1)}_{{p{primes}}}"


def _feet_inches(match: re.Match) -> str:
    inches = int(match.group(1)) * 12 + Fraction(match.group(2))
    return f"{float(inches):g}" + r" \text{in}"


def _numeral(match: re.Match) -> str:
    digits = (match.group(1) or match.group(2)).upper()
    word = match.group(4) or match.group(6)
    base = _BASE_WORDS.get(word, 0) if word else int(match.group(3) or match.group(5) or match.group(7))
    try:
        valid = 2 <= base <= 36 and int(digits, base) >= 0
    except ValueError:
        valid = False
    return rf"\numeral{{{digits}}}{{{base}}}" if valid else match.group(0)


def rewrite_forms(s: str) -> str:
    """The rewrites of the module docstring, in an order where none undoes another."""
    s = _ISO_INTERVAL.sub(_iso, s)
    s = _LETTER_UNION.sub(r" \\cup ", s)
    s = _BINOM_CALL.sub(_binom, s)
    s = _BINOM_SCRIPTS.sub(_binom, s)
    s = _UNIT_VECTOR.sub(_unit_vector, s)
    s = _TEXT_E.sub(lambda m: "e" + m.group(1) + (m.group(2) or m.group(3)), s)
    s = _BASE_NUMERAL.sub(_numeral, s)
    s = _PRIME.sub(_prime, s)
    s = _FEET_INCHES.sub(_feet_inches, s)
    s = _INCHES.sub(r" \\text{in}", s)
    return _FEET.sub(r" \\text{ft}", s)
