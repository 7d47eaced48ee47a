"""In-process evaluation of answer trees, every step bounded: exact rational values (with
size guards that refuse 9^9^9^9, 10^6! or x^(10^6) as too_large), double-precision values at
sample points (evidence that two answers differ), and a light canonical form (sorted sums and
products, folded constants) that proves two spellings of one expression equal. Whatever
these cannot settle goes to sympy in the sandbox."""

from __future__ import annotations

import cmath
import math
from fractions import Fraction

from megatron_rlvr.rewards.math.parse import child_nodes, is_node, map_children
from megatron_rlvr.rewards.math.text import AnswerError

MAX_BITS = 40_000  # ~12,000 digits: any legitimate answer, never a runaway power
MAX_SYMBOLIC_EXPONENT = 1_000
MAX_FACTORIAL = 1_000
ONE_HUNDRED = ("num", Fraction(100))
DEGREE = ("div", ("const", "pi"), ("num", Fraction(180)))


def _bits(value: Fraction) -> int:
    return max(abs(value.numerator).bit_length(), value.denominator.bit_length())


def _checked(value: Fraction) -> Fraction:
    if _bits(value) > MAX_BITS:
        raise AnswerError("too_large")
    return value


def _exact_root(value: Fraction, n: int) -> Fraction | None:
    """The rational n-th root of a non-negative rational, when there is one."""
    roots = []
    for part in (value.numerator, value.denominator):
        root = round(part ** (1.0 / n)) if part < 2**50 else _integer_root(part, n)
        for candidate in (root - 1, root, root + 1):
            if candidate >= 0 and candidate**n == part:
                roots.append(candidate)
                break
        else:
            return None
    return Fraction(roots[0], roots[1])


def _integer_root(x: int, n: int) -> int:
    if n == 2:
        return math.isqrt(x)
    low, high = 0, 1 << (x.bit_length() // n + 1)
    while low < high:
        mid = (low + high + 1) // 2
        if mid**n <= x:
            low = mid
        else:
            high = mid - 1
    return low


def _power(base: Fraction | None, exponent: Fraction | None) -> Fraction | None:
    if exponent is not None and base is None:
        if abs(exponent) > MAX_SYMBOLIC_EXPONENT:
            raise AnswerError("too_large")
        return None
    if base is None or exponent is None:
        return None
    if base == 0:
        return None if exponent <= 0 else Fraction(0)
    if base in (1, -1) and exponent.denominator == 1:
        return base ** int(exponent)
    if _bits(base) * abs(exponent) > MAX_BITS or abs(exponent) > MAX_BITS:
        raise AnswerError("too_large")
    if exponent.denominator == 1:
        return _checked(base ** int(exponent))
    if base < 0:
        return None  # a principal complex root: sympy's business
    root = _exact_root(base, exponent.denominator)
    return None if root is None else _checked(root**exponent.numerator)


def _log(value: Fraction | None, base: Fraction | None) -> Fraction | None:
    """log_base(value) when it is a rational with a small denominator (log_2 8, log_4 2)."""
    if value is None or base is None or value <= 0 or base <= 0 or base == 1:
        return None
    if value == 1:
        return Fraction(0)
    try:
        guess = Fraction(math.log(value) / math.log(base)).limit_denominator(12)
    except (ValueError, OverflowError, ZeroDivisionError):
        return None
    if guess == 0 or abs(guess) > 10_000:
        return None
    p, q = guess.numerator, guess.denominator
    if _bits(base) * abs(p) > MAX_BITS or _bits(value) * q > MAX_BITS:
        return None
    return guess if base**p == value**q else None


def rational(node) -> Fraction | None:
    """The exact value of a purely numeric rational expression, else None. Visits every
    child, so a too-large part anywhere raises AnswerError("too_large")."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind in ("sym", "const", "text", "empty"):
        return None
    values = [rational(child) for child in child_nodes(node)]
    if kind == "neg":
        return None if values[0] is None else -values[0]
    if kind in ("add", "mul"):
        known = [value for value in values if value is not None]
        if len(known) < len(values):
            return None
        total = Fraction(0 if kind == "add" else 1)
        for value in known:
            total = _checked(total + value if kind == "add" else total * value)
        return total
    if kind == "div":
        a, b = values
        return None if a is None or b is None or b == 0 else _checked(a / b)
    if kind == "pow":
        return _power(*values)
    if kind == "pct":
        return None if values[0] is None else values[0] / 100
    if kind == "deg":
        return Fraction(0) if values[0] == 0 else None
    if kind == "fn":
        return _function(node[1], values)
    return None


def _function(name: str, args: list) -> Fraction | None:
    x = args[0]
    if name == "sqrt":
        return None if x is None or x < 0 else _exact_root(x, 2)
    if name == "root":
        n = args[1]
        if x is None or n is None or n.denominator != 1 or n < 2 or n > 1000:
            return None
        if x < 0:
            root = _exact_root(-x, int(n)) if n % 2 == 1 else None
            return None if root is None else -root
        return _exact_root(x, int(n))
    if name == "factorial":
        if x is None or x.denominator != 1 or x < 0:
            return None
        if x > MAX_FACTORIAL:
            raise AnswerError("too_large")
        return Fraction(math.factorial(int(x)))
    if name == "binom":
        n, k = args
        if n is None or k is None or n.denominator != 1 or k.denominator != 1 or n < 0:
            return None
        if k < 0 or k > n:
            return Fraction(0)
        if min(k, n - k) * max(1, int(n).bit_length()) > MAX_BITS:
            raise AnswerError("too_large")
        return Fraction(math.comb(int(n), int(k)))
    if name == "abs":
        return None if x is None else abs(x)
    if name in ("floor", "ceiling"):
        return None if x is None else Fraction(math.floor(x) if name == "floor" else math.ceil(x))
    if name == "log":
        if len(args) == 2:
            return _log(x, args[1])
        return Fraction(0) if x == 1 else None
    if name in ("sin", "tan", "arcsin", "arctan", "sinh", "tanh") and x == 0:
        return Fraction(0)
    if name in ("cos", "cosh", "exp") and x == 0:
        return Fraction(1)
    return None


# ============================================================================ floating point
class Undecided(Exception):
    """A double-precision evaluation that cannot be trusted (overflow, a domain edge)."""


class Approximator:
    """complex values of an expression at sample points; `scale` is the largest intermediate
    magnitude met, the yardstick for rounding error."""

    def __init__(self, env: dict[str, complex]):
        self.env = env
        self.scale = 1.0

    def value(self, node) -> complex:
        try:
            v = self._value(node)
        except (OverflowError, ZeroDivisionError, ValueError, TypeError):
            raise Undecided from None
        if not (cmath.isfinite(v)):
            raise Undecided
        if v.imag == 0:
            v = complex(v.real, 0.0)  # -0.0 would put sqrt(-4) on the wrong side of the branch cut
        self.scale = max(self.scale, abs(v))
        return v

    def _value(self, node) -> complex:
        kind = node[0]
        if kind == "num":
            return complex(float(node[1]))
        if kind == "sym":
            return self.env[node[1]]
        if kind == "const":
            if node[1] == "oo":
                raise Undecided
            return {"pi": math.pi, "e": math.e, "i": 1j}[node[1]]
        if kind == "neg":
            return -self.value(node[1])
        if kind == "add":
            return sum((self.value(t) for t in node[1]), 0j)
        if kind == "mul":
            product = 1 + 0j
            for factor in node[1]:
                product *= self.value(factor)
            return product
        if kind == "div":
            return self.value(node[1]) / self.value(node[2])
        if kind == "pow":
            base, exponent = self.value(node[1]), self.value(node[2])
            if exponent.imag == 0 and exponent.real == int(exponent.real) and abs(exponent.real) <= 64:
                return base ** int(exponent.real)
            return base**exponent
        if kind == "pct":
            return self.value(node[1]) / 100
        if kind == "deg":
            return self.value(node[1]) * math.pi / 180
        if kind == "fn":
            return self._function(node[1], [self.value(a) for a in node[2]])
        raise Undecided

    @staticmethod
    def _real(x: complex, low: float = -math.inf, high: float = math.inf) -> float:
        if x.imag != 0 or not low <= x.real <= high:
            raise Undecided  # branch cuts: leave them to sympy
        return x.real

    def _function(self, name: str, args: list[complex]) -> complex:
        x = args[0]
        if name in ("sin", "cos", "tan", "cot", "sec", "csc", "cis") and abs(x) > 1e6:
            raise Undecided  # a double has no digits left to reduce sin(10^20) by 2pi
        simple = {
            "sqrt": cmath.sqrt,
            "sin": cmath.sin,
            "cos": cmath.cos,
            "tan": cmath.tan,
            "exp": cmath.exp,
            "sinh": cmath.sinh,
            "cosh": cmath.cosh,
            "tanh": cmath.tanh,
        }
        if name in simple:
            return simple[name](x)
        if name in ("cot", "sec", "csc"):
            return 1 / {"cot": cmath.tan, "sec": cmath.cos, "csc": cmath.sin}[name](x)
        if name in ("arcsin", "arccos"):
            return (math.asin if name == "arcsin" else math.acos)(self._real(x, -1, 1))
        if name == "arctan":
            return math.atan(self._real(x))
        if name == "arccot":
            return math.atan(1 / self._real(x))
        if name == "log":
            base = cmath.log(args[1]) if len(args) == 2 else 1
            return cmath.log(x) / base
        if name == "root":
            n = self._real(args[1])
            if x.imag == 0 and x.real < 0 and n == int(n) and int(n) % 2 == 1:
                return -((-x.real) ** (1 / n))
            return x ** (1 / n)
        if name == "abs":
            return abs(x)
        if name in ("floor", "ceiling"):
            return (math.floor if name == "floor" else math.ceil)(self._real(x))
        if name == "factorial":
            return math.gamma(self._real(x, -0.999, 170) + 1)
        if name == "binom":
            n, k = self._real(x, -0.999, 170), self._real(args[1], -0.999, 170)
            return math.gamma(n + 1) / (math.gamma(k + 1) * math.gamma(n - k + 1))
        if name == "cis":
            return cmath.exp(1j * x)
        raise Undecided


def symbols(node, found: set | None = None) -> set:
    found = set() if found is None else found
    if node[0] == "sym":
        found.add(node[1])
    else:
        map_children(node, lambda child: symbols(child, found) or child)
    return found


def sample_points(names: set, count: int = 2) -> list[dict[str, complex]]:
    """Deterministic, distinct positive points in (0.2, 0.95): in the domain of sqrt(1-x),
    arcsin x, log x, away from 0 and 1 where special cases live."""
    ordered = sorted(names)
    return [
        {
            name: complex(0.2 + 0.75 * (((k + 1) * 0.6180339887 + j * 0.4142135623 + 0.1 * j) % 1.0))
            for k, name in enumerate(ordered)
        }
        for j in range(count)
    ]


def values_differ(a, b, tolerance: float = 1e-7) -> bool | None:
    """True when a and b evaluate to clearly different numbers at some sample point, None
    when double precision cannot tell."""
    points = sample_points(symbols(a) | symbols(b))
    decided = False
    for env in points:
        approximator = Approximator(env)
        try:
            va, vb = approximator.value(a), approximator.value(b)
        except Undecided:
            continue
        decided = True
        if abs(va - vb) > tolerance * approximator.scale:
            return True
    return False if decided else None


# ============================================================================ canonical form
def canonical(node):
    """Sums and products flattened and sorted, numeric parts folded, a − b as a + (−1)b and
    a / b as a·b⁻¹: two spellings with the same canonical form are the same expression."""
    if not is_node(node):
        return node
    value = rational(node) if node[0] not in ("num", "sym", "const") else None
    if value is not None:
        return ("num", value)
    kind = node[0]
    if kind == "neg":
        return canonical(("mul", (("num", Fraction(-1)), node[1])))
    if kind == "div":
        return canonical(("mul", (node[1], ("pow", node[2], ("num", Fraction(-1))))))
    if kind == "pct":
        return canonical(("div", node[1], ONE_HUNDRED))
    if kind == "deg":
        return canonical(("mul", (node[1], DEGREE)))
    if kind in ("add", "mul"):
        parts = []
        for child in node[1]:
            child = canonical(child)
            parts.extend(child[1] if child[0] == kind else (child,))
        constant = Fraction(0 if kind == "add" else 1)
        rest = []
        for part in parts:
            if part[0] == "num":
                constant = _checked(constant + part[1] if kind == "add" else constant * part[1])
            else:
                rest.append(part)
        if kind == "mul" and constant == 0:
            return ("num", Fraction(0))
        if constant != (0 if kind == "add" else 1) or not rest:
            rest.append(("num", constant))
        if len(rest) == 1:
            return rest[0]
        return (kind, tuple(sorted(rest, key=repr)))
    return map_children(node, canonical)
