"""The sympy side of the comparison, imported only inside sandbox workers. Trees become sympy
objects by constructor calls (no parser, no eval); equality is decided by exact structure,
then by 60-digit evaluation: of numbers, or, with variables, at three fresh random points
(identity testing; simplify only where evaluation fails)."""

from __future__ import annotations

import random

import sympy

from megatron_rlvr.rewards.math.compare import FastBackend, Tri, _difference
from megatron_rlvr.rewards.math.parse import child_nodes
from megatron_rlvr.rewards.math.text import AnswerError

DIGITS = 60
_FUNCTIONS = {
    "sqrt": sympy.sqrt,
    "sin": sympy.sin,
    "cos": sympy.cos,
    "tan": sympy.tan,
    "cot": sympy.cot,
    "sec": sympy.sec,
    "csc": sympy.csc,
    "arcsin": sympy.asin,
    "arccos": sympy.acos,
    "arctan": sympy.atan,
    "arccot": sympy.acot,
    "sinh": sympy.sinh,
    "cosh": sympy.cosh,
    "tanh": sympy.tanh,
    "exp": sympy.exp,
    "abs": sympy.Abs,
    "floor": sympy.floor,
    "ceiling": sympy.ceiling,
    "factorial": sympy.factorial,
    "binom": sympy.binomial,
}
_CONSTANTS = {"pi": sympy.pi, "e": sympy.E, "i": sympy.I, "oo": sympy.oo}
_UNDEFINED = (sympy.zoo, sympy.nan)


def to_sympy(node, real_only: bool = False):
    """The sympy object of an expression tree. Variables are positive (so log x + log y is
    log xy, as graders expect), or only real when solving inequalities."""
    kind = node[0]
    if kind == "num":
        return sympy.Rational(node[1].numerator, node[1].denominator)
    if kind == "sym":
        return sympy.Symbol(node[1], real=True) if real_only else sympy.Symbol(node[1], positive=True)
    if kind == "const":
        return _CONSTANTS[node[1]]
    args = [to_sympy(child, real_only) for child in child_nodes(node)]
    if kind == "neg":
        return -args[0]
    if kind == "add":
        return sympy.Add(*args)
    if kind == "mul":
        return sympy.Mul(*args)
    if kind == "div":
        return args[0] / args[1]
    if kind == "pow":
        return sympy.Pow(args[0], args[1])
    if kind == "pct":
        return args[0] / 100
    if kind == "deg":
        return args[0] * sympy.pi / 180
    if kind == "fn":
        name = node[1]
        if name == "log":
            return sympy.log(args[0]) if len(args) == 1 else sympy.log(args[0]) / sympy.log(args[1])
        if name == "root":
            x, n = args
            if n.is_integer and n.is_odd and x.is_number and x.is_negative:
                return -sympy.root(-x, n)
            return sympy.root(x, n)
        if name == "cis":
            return sympy.cos(args[0]) + sympy.I * sympy.sin(args[0])
        return _FUNCTIONS[name](*args)
    raise AnswerError("parse_error")


def _close(a, b) -> bool | None:
    """Whether two numbers agree to ~45 digits; None when they do not evaluate to numbers."""
    try:
        va, vb = complex(sympy.N(a, DIGITS)), complex(sympy.N(b, DIGITS))
    except (TypeError, ValueError):
        return None
    if va != va or vb != vb:
        return None
    scale = max(1.0, abs(va), abs(vb))
    if abs(va - vb) > 1e-12 * scale:
        return False
    difference = sympy.N(a - b, DIGITS)
    try:
        return abs(complex(difference)) <= 1e-40 * scale
    except (TypeError, ValueError):
        return None


def _random_points(free, count: int = 3) -> list[dict]:
    """Fresh random positive rationals for each variable: a response cannot be built to agree
    with the gold answer at points it cannot know."""
    rng = random.SystemRandom()
    return [{s: sympy.Rational(rng.randint(100, 1900), 1000) for s in free} for _ in range(count)]


class SympyBackend(FastBackend):
    """FastBackend first; what it leaves undecided, sympy decides."""

    def expr_equal(self, a, b, note) -> Tri:
        fast = super().expr_equal(a, b, note)
        if fast is not None:
            return fast
        return note(self._sympy_equal(to_sympy(a), to_sympy(b)), "sympy")

    @staticmethod
    def _sympy_equal(ea, eb) -> bool:
        if ea == eb:
            return True
        if any(ea.has(u) or eb.has(u) for u in _UNDEFINED + (sympy.oo, -sympy.oo)):
            return False
        free = ea.free_symbols | eb.free_symbols
        if not free:
            close = _close(ea, eb)
            if close is not None:
                return close
            return sympy.simplify(ea - eb) == 0
        agreed = [_close(ea.subs(point), eb.subs(point)) for point in _random_points(free)]
        if False in agreed:
            return False
        if all(agreed):  # 45 digits at three random points: the same function
            return True
        return sympy.simplify(ea - eb) == 0

    def relation_equal(self, a, b, note) -> Tri:
        fast = super().relation_equal(a, b, note)
        if fast is not None:
            return fast
        da, db = to_sympy(_difference(a)), to_sympy(_difference(b))
        if da == 0 or db == 0:
            return note(False, "sympy")
        ratio = sympy.cancel(sympy.simplify(da / db))
        if ratio.free_symbols or ratio in _UNDEFINED or ratio == 0:
            return note(False, "sympy")
        if a[2][0] != "=" and not ratio.is_positive:
            return note(False, "sympy")
        return note(True, "sympy")

    def real_set_equal(self, a, b, note) -> Tri:
        sa, sb = to_set(a), to_set(b)
        if sa is None or sb is None:
            return note(False, "shape")
        if sa == sb:
            return note(True, "sympy")
        left, right = sympy.Complement(sa, sb), sympy.Complement(sb, sa)
        return note(left == sympy.S.EmptySet and right == sympy.S.EmptySet, "sympy")


def to_set(node):
    """A set of reals as a sympy Set: intervals, unions, finite sets, solved inequalities."""
    kind = node[0]
    if kind == "empty":
        return sympy.S.EmptySet
    if kind == "interval":
        lo, hi = to_sympy(node[1], True), to_sympy(node[2], True)
        return sympy.Interval(lo, hi, node[3], node[4])
    if kind == "tuple" and len(node[1]) == 2:
        return sympy.Interval.open(to_sympy(node[1][0], True), to_sympy(node[1][1], True))
    if kind in ("union", "list"):
        parts = [to_set(part) for part in node[1]]
        if any(p is None for p in parts):
            return None
        if kind == "list" and all(item[0] == "rel" and item[2] == ("!=",) for item in node[1]):
            return sympy.Intersection(*parts)  # x != ±2
        return sympy.Union(*parts)
    if kind == "set":
        return sympy.FiniteSet(*(to_sympy(item, True) for item in node[1]))
    if kind == "rel":
        return _solve(node)
    if kind == "setminus":
        a, b = to_set(node[1]), to_set(node[2])
        return None if a is None or b is None else sympy.Complement(a, b)
    return None


_RELATIONS = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge, "=": sympy.Eq, "!=": sympy.Ne}


def _solve(node):
    members = [to_sympy(m, True) for m in node[1]]
    free = set().union(*(m.free_symbols for m in members))
    if len(free) != 1:
        return None
    (variable,) = free
    solved = sympy.S.Reals
    for left, op, right in zip(members, node[2], members[1:]):
        solved = sympy.Intersection(solved, sympy.solveset(_RELATIONS[op](left, right), variable, sympy.S.Reals))
    return solved
