"""Are two answer trees the same answer? Decided the way graders of MATH, GSM8K, AIME and
OlympiadBench answers decide, with three outcomes: True, False, or None when only sympy can
tell (then the pair goes to the sandbox, which runs this same code with a sympy backend).

The rules, in order:
- a choice letter equals the same letter, with or without its parentheses or value; several
  letters compare as a set (`C, A` = `(A), (C)` = `AC`);
- math.shapes first: unit vectors against a vector, a scalar times a matrix, a numeral in a base
  against the same digits; values boxed one by one against a point that cannot be an interval;
- words equal the same words (case and punctuation aside); "no solution" is the empty set;
- `x \\in S` is S; an equation chain in the response is its last member when the gold answer is
  not an equation (`x = 3` is 3, `x = 10/2 = 5` is 5), and a gold `y = 2x + 3` (a name on the
  left) is its right side when the response is not an equation;
- solution lists, sets and several boxes compare as sets (`x = 3 or x = -4` = `{3, -4}` =
  `-4, 3`); several values against one gold value is a hedge, and wrong;
- intervals, unions and one-variable inequalities compare as sets of reals (`x > -1` =
  `(-1, oo)`, never `[-1, oo)`); `(a, b)` is an open interval only against another set of reals;
- tuples, vectors (`\\langle\\rangle`, one-row or one-column matrices) compare in order, matrices
  by shape and entry; a set is never a tuple or a point;
- equations are the same curve when one side minus the other is proportional (`3x + y = 6` =
  `y = 6 - 3x`); inequalities in several variables when the ratio is positive;
- `p%` equals p and p/100 (as math-verify does); an angle in degrees equals the same number
  and its value in radians (`30°` = `30` = `π/6`); unmarked numbers compare as they are;
- expressions are equal when their exact values are (decimals are exact: 0.33 is not 1/3,
  3e2 is 300 and never 6e), when their canonical forms agree, or when sympy proves it.
"""

from __future__ import annotations

from megatron_rlvr.rewards.math.evaluate import (
    DEGREE,
    ONE_HUNDRED,
    Approximator,
    Undecided,
    canonical,
    rational,
    sample_points,
    symbols,
    values_differ,
)
from megatron_rlvr.rewards.math.parse import INFINITY
from megatron_rlvr.rewards.math.shapes import choice_letters, numeral_equal, scaled_matrix, unit_vector
from megatron_rlvr.rewards.math.text import AnswerError

Tri = bool | None
MAX_PAIRINGS = 2_500  # element comparisons one set comparison may make
_INEQUALITIES = {"<", ">", "<=", ">="}
_COLLECTIONS = {"list", "set"}
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}


def all_of(results) -> Tri:
    undecided = False
    for result in results:
        if result is False:
            return False
        undecided |= result is None
    return None if undecided else True


def any_of(results) -> Tri:
    undecided = False
    for result in results:
        if result is True:
            return True
        undecided |= result is None
    return None if undecided else False


class FastBackend:
    """Leaf decisions that need no sympy: exact values, canonical forms, sampled values."""

    def expr_equal(self, a, b, note) -> Tri:
        ra, rb = rational(a), rational(b)
        if ra is not None and rb is not None:
            return note(ra == rb, "numeric")
        if canonical(a) == canonical(b):
            return note(True, "form")
        if values_differ(a, b):
            return note(False, "value")
        return None

    def relation_equal(self, a, b, note) -> Tri:
        """Equations, or inequalities in several variables (two members each): the same when
        lhs − rhs of one is a constant multiple of the other's (a positive one for
        inequalities). Here only sampled values can show that they are not."""
        da, db = _difference(a), _difference(b)
        ratios = []
        for env in sample_points(symbols(da) | symbols(db)):
            approximator = Approximator(env)
            try:
                va, vb = approximator.value(da), approximator.value(db)
            except Undecided:
                return None
            tolerance = 1e-7 * approximator.scale
            if abs(vb) <= tolerance:
                if abs(va) > tolerance:
                    return note(False, "value")
                return None
            ratios.append(va / vb)
        if abs(ratios[0] - ratios[1]) > 1e-7 * max(1.0, abs(ratios[0])) or abs(ratios[0]) < 1e-9:
            return note(False, "value")
        if not _is_equation(a) and (ratios[0].real <= 0 or abs(ratios[0].imag) > 1e-9):
            return note(False, "value")
        return None

    def real_set_equal(self, a, b, note) -> Tri:
        """Sets of reals that the interval arithmetic here could not settle."""
        return None


class Comparison:
    """One comparison: the verdict of `equal` plus the reason to count."""

    def __init__(self, backend: FastBackend):
        self.backend = backend
        self.true_kinds: set[str] = set()
        self.false_kind = "shape"

    def note(self, result: Tri, kind: str) -> Tri:
        if result is True:
            self.true_kinds.add(kind)
        elif result is False:
            self.false_kind = kind
        return result

    def reason(self, result: Tri) -> str:
        if result is None:
            return "undecided"
        if result:
            for kind in ("sympy", "form", "text", "numeric"):
                if kind in self.true_kinds:
                    return f"{kind}_equal"
            return "numeric_equal"
        return f"{self.false_kind}_mismatch" if self.false_kind != "hedged" else "hedged"

    def shape(self) -> bool:
        self.false_kind = "shape"
        return False

    # ------------------------------------------------------------------ dispatch
    def equal(self, a, b) -> Tri:
        a, b = _unwrap(scaled_matrix(a)), _unwrap(scaled_matrix(b))
        ka, kb = a[0], b[0]
        letters_a, letters_b = choice_letters(a), choice_letters(b)
        if letters_a and letters_b and (ka in _COLLECTIONS or kb in _COLLECTIONS):
            return self.note(letters_a == letters_b, "text")  # C, A against (A), (C) or AC
        numeral = numeral_equal(a, b)
        if numeral is not None:
            return self.note(numeral, "text")
        if "choice" in (ka, kb):
            return self.choice_equal(a, b)
        if "text" in (ka, kb):
            return self.note(ka == kb and a[1] == b[1], "text") if ka == kb else self.shape()
        if ka == "rel" or kb == "rel":
            return self.relation_side(a, b)
        if ka in _COLLECTIONS or kb in _COLLECTIONS:
            return self.collection_equal(a, b)
        if _is_real_set(a) or _is_real_set(b):
            return self.real_set_equal(a, b)
        if ka in ("tuple", "matrix") or kb in ("tuple", "matrix"):
            return self.sequence_equal(a, b)
        if ka in ("pct", "deg") or kb in ("pct", "deg"):
            return self.marked_equal(a, b)
        return self.backend.expr_equal(a, b, self.note)

    def choice_equal(self, a, b) -> Tri:
        if a[0] == b[0] == "choice":
            return self.note(a[1] == b[1], "text")
        choice, other = (a, b) if a[0] == "choice" else (b, a)
        if other in (("sym", choice[1]), ("text", choice[1].lower())):
            return self.note(True, "text")
        if choice[2] is not None:
            return self.equal(choice[2], other) if choice is a else self.equal(other, choice[2])
        return self.shape()

    def relation_side(self, a, b) -> Tri:
        if a[0] == b[0] == "rel":
            return self.relations_equal(a, b)
        if a[0] == "rel":
            if _is_equation(a):
                return self.equal(a[1][-1], b)
            return self.real_set_equal(a, b) if _is_real_set(b) or _is_pair(b) else self.shape()
        if _is_equation(b) and _is_name(b[1][0]):
            return self.equal(a, b[1][-1])
        return self.real_set_equal(a, b) if _is_real_set(b) and (_is_real_set(a) or _is_pair(a)) else self.shape()

    def relations_equal(self, a, b) -> Tri:
        if _is_equation(a) and _is_equation(b) and _is_name(a[1][0]) and a[1][0] == b[1][0]:
            return self.equal(a[1][-1], b[1][-1])  # y = … against y = …
        if _is_real_set(a) and _is_real_set(b):
            return self.real_set_equal(a, b)
        if len(a[1]) != 2 or len(b[1]) != 2:
            return self.shape()
        if _is_equation(a) != _is_equation(b):
            return self.shape()
        if not _is_equation(a) and _strict(a[2][0]) != _strict(b[2][0]):
            return self.shape()
        return self.backend.relation_equal(a, b, self.note)

    # ------------------------------------------------------------------ collections
    def collection_equal(self, a, b) -> Tri:
        if a[0] in _COLLECTIONS and b[0] in _COLLECTIONS:
            return self.set_equal(a[1], b[1])
        coll, other = (a, b) if a[0] in _COLLECTIONS else (b, a)
        if other[0] == "empty":
            return self.note(not coll[1], "numeric") if not coll[1] else self.shape()
        if (coll[0] == "list" and _is_real_set(coll) or coll[0] == "set") and _is_real_set(other):
            return self.real_set_equal(a, b)
        if len(coll[1]) == 1:
            return self.equal(coll[1][0], other) if coll is a else self.equal(other, coll[1][0])
        if other[0] == "tuple" and _named_values(coll, len(other[1])):  # x = 1, y = 2 against (1, 2)
            values = ("tuple", _named_values(coll, len(other[1])))
            return self.equal(values, other) if coll is a else self.equal(other, values)
        if coll is a and coll[0] == "list" and other[0] == "tuple" and _point_of(coll, other):
            return self.equal(("tuple", coll[1]), other)  # \boxed{3}, \boxed{-2} against (3, -2)
        if coll is a and other[0] not in ("tuple", "matrix", "interval", "union"):
            result = self.set_equal(a[1], (b,))  # several answers to a one-answer question
            if result is False:
                self.false_kind = "hedged"
            return result
        return self.shape()

    def set_equal(self, xs, ys) -> Tri:
        """Every x is some y and every y is some x (repeats do not count)."""
        if not xs or not ys:
            return self.note(not xs and not ys, "numeric") if not xs and not ys else self.shape()
        values = [None if item[0] in ("list", "set", "pct", "deg") else rational(item) for item in (*xs, *ys)]
        if None not in values:  # numbers only: compare the sets of values, in linear time
            return self.note(set(values[: len(xs)]) == set(values[len(xs) :]), "numeric")
        if len(xs) * len(ys) > MAX_PAIRINGS:
            raise AnswerError("too_large")
        covered = all_of(any_of(self.equal(x, y) for y in ys) for x in xs)
        if covered is False:
            return False
        back = all_of(any_of(self.equal(x, y) for x in xs) for y in ys)
        return all_of((covered, back))

    def sequence_equal(self, a, b) -> Tri:
        a, b = _as_sequence(a), _as_sequence(b)
        if a[0] == "tuple" and b[0] not in ("tuple", "matrix"):
            b = unit_vector(b, len(a[1])) or b
        elif b[0] == "tuple" and a[0] not in ("tuple", "matrix"):
            a = unit_vector(a, len(b[1])) or a
        if a[0] != b[0] or a[0] not in ("tuple", "matrix"):
            return self.shape()
        if a[0] == "matrix":
            if len(a[1]) != len(b[1]) or len(a[1][0]) != len(b[1][0]):
                return self.shape()
            return all_of(self.equal(x, y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb))
        if len(a[1]) != len(b[1]):
            return self.shape()
        return all_of(self.equal(x, y) for x, y in zip(a[1], b[1]))

    # ------------------------------------------------------------------ marked numbers
    def marked_equal(self, a, b) -> Tri:
        if a[0] == b[0]:
            return self.equal(a[1], b[1])
        if a[0] in ("pct", "deg") and b[0] in ("pct", "deg"):
            return self.shape()
        marked, other = (a, b) if a[0] in ("pct", "deg") else (b, a)
        inner = marked[1]
        scaled = ("div", inner, ONE_HUNDRED) if marked[0] == "pct" else ("mul", (inner, DEGREE))
        return any_of((self.equal(inner, other), self.equal(scaled, other)))

    # ------------------------------------------------------------------ sets of reals
    def real_set_equal(self, a, b) -> Tri:
        if not all(_is_real_set(x) or x[0] in ("tuple", "set") for x in (a, b)):
            return self.shape()  # a set of reals is never a number or an expression
        ia, ib = intervals(a), intervals(b)
        if ia is None or ib is None:
            return self.backend.real_set_equal(a, b, self.note)
        if len(ia) != len(ib):
            return self.backend.real_set_equal(a, b, self.note)
        checks = []
        for (lo_a, hi_a, lo_open_a, hi_open_a), (lo_b, hi_b, lo_open_b, hi_open_b) in zip(ia, ib):
            if (lo_open_a or _infinite(lo_a)) != (lo_open_b or _infinite(lo_b)) or (hi_open_a or _infinite(hi_a)) != (
                hi_open_b or _infinite(hi_b)
            ):
                return self.shape()
            checks += [self.endpoint_equal(lo_a, lo_b), self.endpoint_equal(hi_a, hi_b)]
        return all_of(checks)

    def endpoint_equal(self, a, b) -> Tri:
        if _infinite(a) or _infinite(b):
            return self.note(_infinite(a) == _infinite(b), "numeric")
        return self.backend.expr_equal(a, b, self.note)


# ============================================================================ helpers
def _unwrap(node):
    if node[0] == "rel" and node[2] == ("in",):
        return node[1][1]  # x \in S
    if node[0] == "list" and len(node[1]) == 1:
        return node[1][0]
    if node[0] == "matrix" and len(node[1]) == 1 and len(node[1][0]) == 1:
        return node[1][0][0]
    return node


def _as_sequence(node):
    """One-row and one-column matrices are vectors, the same as tuples."""
    if node[0] == "matrix" and (len(node[1]) == 1 or len(node[1][0]) == 1):
        return ("tuple", tuple(x for row in node[1] for x in row))
    return node


def _difference(relation):
    """lhs − rhs of a two-member relation, with > and >= turned around to < and <=."""
    lhs, rhs = relation[1]
    if relation[2][0] in (">", ">="):
        lhs, rhs = rhs, lhs
    return ("add", (lhs, ("neg", rhs)))


def _named_values(coll, length: int) -> tuple | None:
    """The right sides of `x = 1, y = 2` (distinct names, by name: y = 2, x = 1 is (1, 2) too),
    else None."""
    items = coll[1]
    if coll[0] != "list" or len(items) != length:
        return None
    if not all(_is_equation(i) and len(i[1]) == 2 and i[1][0][0] == "sym" for i in items):
        return None
    if len({i[1][0] for i in items}) != len(items):
        return None
    return tuple(i[1][1] for i in sorted(items, key=lambda i: i[1][0][1]))


def _point_of(values, point) -> bool:
    """Whether a list of plain values reads as the point: as many values, and a point that
    cannot be an open interval (a pair (a, b) with a < b could be one)."""
    items = values[1]
    if len(items) != len(point[1]) or any(x[0] in ("rel", "tuple", "set", "list", "interval", "text") for x in items):
        return False
    if len(items) == 2:
        lo, hi = rational(point[1][0]), rational(point[1][1])
        return lo is not None and hi is not None and lo >= hi
    return True


def _is_equation(node) -> bool:
    return node[0] == "rel" and all(op == "=" for op in node[2])


def _is_name(node) -> bool:
    """x, x_1, f(x) (parsed as f·x), (x, y): what names a value on an equation's left."""
    if node[0] == "sym":
        return True
    if node[0] == "mul":  # f(x), f^{-1}(x)
        return len(node[1]) <= 3 and all(f[0] == "sym" or f[0] == "pow" and f[1][0] == "sym" for f in node[1])
    if node[0] == "tuple":
        return all(item[0] == "sym" for item in node[1])
    return False


def _strict(op: str) -> bool:
    return op in ("<", ">")


def _infinite(node) -> int:
    """+1 for oo, -1 for -oo, 0 otherwise."""
    if node == INFINITY:
        return 1
    if node == ("neg", INFINITY):
        return -1
    return 0


def _is_real_set(node) -> bool:
    kind = node[0]
    if kind in ("interval", "union", "empty", "setminus"):
        return True
    if kind == "rel":
        return any(op in _INEQUALITIES or op == "!=" for op in node[2])
    if kind == "list":
        return bool(node[1]) and all(item[0] == "rel" and _is_real_set(item) for item in node[1])
    return False


def _is_pair(node) -> bool:
    """(a, b): a point, or an open interval against a set of reals."""
    return node[0] == "tuple" and len(node[1]) == 2


def _constant(node) -> bool:
    return not symbols(node)


def _relation_intervals(node) -> list | None:
    """x op c, c op x, c1 op x op c2 (one variable, constant bounds) → intervals."""
    members, ops = node[1], node[2]
    names = [m for m in members if m[0] == "sym"]
    if len(names) != 1 or not all(m is names[0] or _constant(m) for m in members):
        return None
    if len(members) == 2:
        var_first = members[0][0] == "sym"
        op = ops[0] if var_first else _FLIP.get(ops[0], ops[0])
        c = members[1] if var_first else members[0]
        if op == "!=":
            return [(("neg", INFINITY), c, True, True), (c, INFINITY, True, True)]
        if op in ("<", "<="):
            return [(("neg", INFINITY), c, True, op == "<")]
        if op in (">", ">="):
            return [(c, INFINITY, op == ">", True)]
        return None
    if len(members) == 3 and members[1][0] == "sym" and members[0] != members[1]:
        lo, hi = members[0], members[2]
        if ops[0] in ("<", "<=") and ops[1] in ("<", "<="):
            return [(lo, hi, ops[0] == "<", ops[1] == "<")]
        if ops[0] in (">", ">=") and ops[1] in (">", ">="):
            return [(hi, lo, ops[1] == ">", ops[0] == ">")]
    return None


def _sort_key(endpoint) -> float:
    sign = _infinite(endpoint)
    if sign:
        return float(sign) * float("inf")
    value = rational(endpoint)
    if value is not None:
        return float(value)
    try:
        v = Approximator({}).value(endpoint)
    except Undecided:
        raise _NoOrder from None
    if v.imag:
        raise _NoOrder
    return v.real


class _NoOrder(Exception):
    pass


def _puncture(pieces: list, point) -> list:
    """The pieces with one point taken out (R minus {0} is (-oo, 0) and (0, oo))."""
    at = _sort_key(point)
    out = []
    for lo, hi, lo_open, hi_open in pieces:
        low, high = _sort_key(lo), _sort_key(hi)
        if low < at < high:
            out += [(lo, point, lo_open, True), (point, hi, True, hi_open)]
        elif at == low == high:
            continue
        else:
            out.append((lo, hi, lo_open or at == low, hi_open or at == high))
    return out


def intervals(node) -> list | None:
    """A set of reals as sorted (lo, hi, lo_open, hi_open) pieces, or None when only sympy can
    say (|x - 1| < 2, x^2 < 4, symbolic bounds)."""
    kind = node[0]
    pieces: list | None
    if kind == "interval":
        pieces = [node[1:]]
    elif kind == "tuple" and len(node[1]) == 2:
        pieces = [(node[1][0], node[1][1], True, True)]
    elif kind == "empty":
        pieces = []
    elif kind == "list" and all(item[0] == "rel" and item[2] == ("!=",) for item in node[1]):
        pieces = [(("neg", INFINITY), INFINITY, True, True)]  # x != ±2: every one of them holds
        try:
            for item in node[1]:
                point = item[1][1] if item[1][0][0] == "sym" else item[1][0]
                if not _constant(point):
                    return None
                pieces = _puncture(pieces, point)
        except _NoOrder:
            return None
    elif kind == "union" or kind == "list":
        pieces = []
        for part in node[1]:
            sub = intervals(part)
            if sub is None:
                return None
            pieces += sub
    elif kind == "set":
        if not all(_constant(item) and item[0] not in ("tuple", "set") for item in node[1]):
            return None
        pieces = [(item, item, False, False) for item in node[1]]
    elif kind == "rel":
        pieces = _relation_intervals(node)
        if pieces is None:
            return None
    elif kind == "setminus":
        pieces, removed = intervals(node[1]), intervals(node[2])
        if pieces is None or removed is None or any(lo is not hi for lo, hi, _, _ in removed):
            return None
        try:
            for point, _, _, _ in removed:
                pieces = _puncture(pieces, point)
        except _NoOrder:
            return None
    else:
        return None
    if any(not (_constant(lo) and _constant(hi)) for lo, hi, _, _ in pieces):
        return None
    try:
        return sorted(pieces, key=lambda p: (_sort_key(p[0]), _sort_key(p[1])))
    except _NoOrder:
        return None


def compare(pred, gold, backend: FastBackend) -> tuple[Tri, str]:
    """(True | False | None, reason) for a response's answer tree against the gold one."""
    comparison = Comparison(backend)
    result = comparison.equal(pred, gold)
    return result, comparison.reason(result)
