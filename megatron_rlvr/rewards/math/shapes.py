"""Answer trees that name the same object in another shape, turned into the shape of the other
answer before math.compare compares them:

- a sum of unit vectors (`3\\hat{i} - 2\\hat{j} + \\hat{k}`, math.forms spells them all
  `\\hat{·}`) is the vector of its coefficients, when it is linear in them with no constant;
- a scalar times a matrix (`\\frac{1}{2}\\begin{pmatrix}…\\end{pmatrix}`) is the scaled matrix;
- a numeral in another base (`1011_2`, read as one name) equals the same digits written plainly,
  never its value in base ten (`11` is not an answer to "write it in base 2");
- several choice letters (`C, A`, `(A)(C)`, `AC`) are a set of letters.
"""

from __future__ import annotations

import re
from fractions import Fraction

from megatron_rlvr.rewards.math.evaluate import rational, symbols
from megatron_rlvr.rewards.math.parse import child_nodes, map_children

UNIT_NAMES = ("hat{i}", "hat{j}", "hat{k}")
_NUMERAL = re.compile(r"(?<![0-9A-Z])([0-9][0-9A-Z]*)_(\d+)")
_LETTERS = set("ABCDE")


def _substitute(node, values: dict):
    if node[0] == "sym" and node[1] in values:
        return ("num", Fraction(values[node[1]]))
    return map_children(node, lambda child: _substitute(child, values))


def _units_only_as_factors(node) -> bool:
    """No unit vector under a power, a function or a denominator: the sum is linear in them."""
    if node[0] in ("pow", "fn") or node[0] == "div" and symbols(node[2]) & set(UNIT_NAMES):
        return not symbols(node) & set(UNIT_NAMES)
    return all(_units_only_as_factors(child) for child in child_nodes(node))


def unit_vector(node, length: int):
    """The ("tuple", components) of a sum of `length` unit vectors, else None."""
    names = symbols(node) & set(UNIT_NAMES)
    if not names or length not in (2, 3) or any(UNIT_NAMES.index(n) >= length for n in names):
        return None
    if not _units_only_as_factors(node):
        return None
    zero = dict.fromkeys(UNIT_NAMES, 0)
    if rational(_substitute(node, zero)) != 0:  # 3 + 4\mathbf{i} is no vector
        return None
    return ("tuple", tuple(_substitute(node, {**zero, name: 1}) for name in UNIT_NAMES[:length]))


def scaled_matrix(node):
    """c·M (or −M) with one matrix factor → the matrix with every entry multiplied by c."""
    if node[0] == "neg" and node[1][0] == "matrix":
        return ("matrix", tuple(tuple(("neg", x) for x in row) for row in node[1][1]))
    if node[0] != "mul":
        return node
    matrices = [f for f in node[1] if f[0] == "matrix"]
    scalars = [f for f in node[1] if f[0] != "matrix"]
    if len(matrices) != 1 or any(f[0] not in ("num", "div", "neg", "pow", "fn", "const", "sym") for f in scalars):
        return node
    return ("matrix", tuple(tuple(("mul", (*scalars, x)) for x in row) for row in matrices[0][1]))


def numeral_equal(a, b) -> bool | None:
    """A numeral in a base against plain digits: equal when the digits are; None when neither
    answer is such a pair."""
    for numeral, plain in ((a, b), (b, a)):
        match = _NUMERAL.fullmatch(numeral[1]) if numeral[0] == "sym" else None
        if match and plain[0] == "num":
            value = plain[1]
            return (
                value.denominator == 1
                and value >= 0
                and str(value.numerator) == match.group(1).lstrip("0")
                or (value == 0 and set(match.group(1)) == {"0"})
            )
    return None


def choice_letters(node) -> frozenset | None:
    """The letters of an answer made only of choice letters: A, (C), C, A, AC, (A)(C)."""
    if node[0] == "sym" and node[1] in _LETTERS:
        return frozenset(node[1])
    if node[0] == "choice" and node[2] is None:
        return frozenset(node[1])
    if node[0] in ("list", "set", "mul"):
        parts = [letters for letters in map(choice_letters, node[1]) if letters]
        if len(parts) == len(node[1]) > 1:
            letters = frozenset().union(*parts)
            return letters if len(letters) == len(parts) else None
    return None
