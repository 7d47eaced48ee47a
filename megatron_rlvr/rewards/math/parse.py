"""A cleaned answer (math.latex.clean) → a tree of plain tuples, by a recursive-descent parser
over math.tokens with a nesting bound. No eval, no sympy: the tree is data that
math.evaluate and math.compare read here, and that the sandbox turns into sympy objects by
constructor calls.

Expressions: ("num", Fraction) ("sym", name) ("const", "pi"|"e"|"i"|"oo") ("add", terms)
("mul", factors) ("div", a, b) ("pow", base, exp) ("neg", a) ("fn", name, args) ("deg", a)
("pct", a) ("pm", a|None, b) ("mp", a|None, b).
Answers: ("rel", members, ops) ("set", items) ("tuple", items) ("list", items)
("interval", lo, hi, left_open, right_open) ("union", parts) ("setminus", a, b) ("matrix", rows)
("text", words) ("empty",) ("choice", letter, rest|None).

A number literal is one token (math.tokens): `3e2` is 300, never 3·e·2; and `2\\frac{1}{2}` (an
integer before a proper numeric fraction) is the mixed number 5/2.
"""

from __future__ import annotations

import re
from fractions import Fraction

from megatron_rlvr.rewards.math.text import AnswerError, matching_brace
from megatron_rlvr.rewards.math.tokens import parse_number, tokenize

MAX_DEPTH = 40

KINDS = {
    "num",
    "sym",
    "const",
    "add",
    "mul",
    "div",
    "pow",
    "neg",
    "fn",
    "deg",
    "pct",
    "pm",
    "mp",
    "rel",
    "set",
    "tuple",
    "list",
    "interval",
    "union",
    "setminus",
    "matrix",
    "text",
    "empty",
    "choice",
}
INFINITY = ("const", "oo")
REALS = ("interval", ("neg", INFINITY), INFINITY, True, True)
_EMPTY_WORDS = {
    "no solution",
    "no solutions",
    "no real solution",
    "no real solutions",
    "empty set",
    "the empty set",
    "no real roots",
    "no roots",
    "no real values",
    "no such number",
}
_REAL_WORDS = {
    "all real numbers",
    "all reals",
    "all real x",
    "all real values",
    "real numbers",
    "all real values of x",
    "every real number",
}
_NUMBER_WORDS = {
    w: n
    for n, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
_INVERSE = {"sin": "arcsin", "cos": "arccos", "tan": "arctan", "cot": "arccot"}
_CONSTANTS = {
    "pi": ("const", "pi"),
    "infty": INFINITY,
    "infinity": INFINITY,
    "emptyset": ("empty",),
    "varnothing": ("empty",),
    "reals": REALS,
}
_MATRICES = {"pmatrix", "bmatrix", "Bmatrix", "matrix", "smallmatrix", "array"}
_RELATIONS = {"=", "<", ">", "<=", ">=", "!=", "in"}
_SEPARATORS = {",", ";", "or", "and"}
_CHOICE = re.compile(  # (C), C, (C) 12, C) 12, C. 12 (never "(A), (C)": several choices)
    r"(?:\(([A-E])\)|([A-E])[).:](?=\s))\s*(?![,;(]|\\TXT\{(?:and|or)\})(.*)|([A-E])"
)


# ============================================================================ grammar
_END = ("end_of_input", "")


class _Parser:
    def __init__(self, tokens: list):
        self.tokens = tokens
        self.at = 0
        self.depth = 0
        self.abs_open = 0
        self.in_exponent = 0  # x^2\frac{1}{2} has no mixed number in its exponent

    def peek(self, ahead: int = 0) -> tuple[str, str]:
        at = self.at + ahead
        return self.tokens[at] if at < len(self.tokens) else _END

    def take(self) -> tuple[str, str]:
        token = self.peek()
        self.at += 1
        return token

    def is_op(self, *values: str) -> bool:
        kind, value = self.peek()
        return kind == "op" and value in values

    def expect(self, value: str) -> None:
        if not self.is_op(value):
            raise AnswerError("parse_error")
        self.at += 1

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise AnswerError("too_deep")

    # ------------------------------------------------------------------ lists and items
    def items(self, closers: tuple[str, ...], expand: bool) -> list:
        found: list = []
        while True:
            if self.is_op(*closers) or self.peek() == _END:
                return found
            item = self.item()
            found.extend(expand_pm(item) if expand else [item])
            if not self.is_op(*_SEPARATORS):
                return found
            while self.is_op(*_SEPARATORS):
                self.take()

    def item(self):
        members, ops = [self.set_expr()], []
        while self.is_op(*_RELATIONS):
            ops.append(self.take()[1])
            members.append(self.set_expr())
        return ("rel", tuple(members), tuple(ops)) if ops else members[0]

    def set_expr(self):
        parts = [self.expr()]
        while self.is_op("cup"):
            self.take()
            parts.append(self.expr())
        node = ("union", tuple(parts)) if len(parts) > 1 else parts[0]
        while self.is_op("setminus"):
            self.take()
            node = ("setminus", node, self.expr())
        return node

    # ------------------------------------------------------------------ arithmetic
    def expr(self):
        terms = [self.term()]
        while self.is_op("+", "-", "pm", "mp"):
            op = self.take()[1]
            right = self.term()
            if op == "+":
                terms.append(right)
            elif op == "-":
                terms.append(("neg", right))
            else:
                left = terms[0] if len(terms) == 1 else ("add", tuple(terms))
                terms = [(op, left, right)]
        return terms[0] if len(terms) == 1 else ("add", tuple(terms))

    def term(self):
        node = self.unary()
        while True:
            kind, value = self.peek()
            if kind == "op" and value in ("*", "/"):
                self.take()
                right = self.unary()
                node = ("div", node, right) if value == "/" else _mul(node, right)
            elif kind == "text":
                node = self.unit(node)
            elif kind in ("deg", "pct"):
                self.take()
                node = (kind, node)
            elif self.starts_operand():
                right = self.power()
                node = right if node[0] == "text" else _mul(node, right)  # leading prose is not math
            else:
                return node

    def unit(self, node):
        """A word after a value: a unit (dropped, with its powers and quotients: m/s^2), or
        'percent' / 'degrees'."""
        word = self.take()[1].lower().strip()
        while True:
            if self.is_op("^"):  # cm^2
                self.take()
                self.exponent()
            elif self.is_op("/", "*") and self.peek(1)[0] == "text":  # m / s
                self.take()
                self.take()
            else:
                break
        if node[0] == "text":
            return ("text", node[1] + " " + word)
        if word in ("percent", "%"):
            return ("pct", node)
        if word in ("degrees", "degree", "deg"):
            return ("deg", node)
        return node

    def starts_operand(self) -> bool:
        kind, value = self.peek()
        if kind in ("num", "id", "const", "fn", "begin"):
            return True
        if kind == "op":
            if value == "|":
                return self.abs_open == 0
            return value in ("(", "[", "{", "\\{", "langle", "lfloor", "lceil")
        return False

    def unary(self):
        negative = False
        while self.is_op("+", "-"):
            negative ^= self.take()[1] == "-"
        if self.is_op("pm", "mp"):
            op = self.take()[1]
            node = (op, None, self.unary())
        else:
            node = self.power()
        return ("neg", node) if negative else node

    def power(self):
        node = self.postfix()
        if self.is_op("^"):
            self.take()
            node = ("pow", node, self.exponent())
            node = self.postfix_ops(node)
        return node

    def exponent(self):
        self.enter()
        self.in_exponent += 1
        if self.is_op("{"):
            node = self.group("{", "}")
        elif self.is_op("-", "+"):
            negative = self.take()[1] == "-"
            node = self.exponent()
            node = ("neg", node) if negative else node
        else:
            node = self.primary()
        if self.is_op("^"):
            self.take()
            node = ("pow", node, self.exponent())
        self.depth -= 1
        self.in_exponent -= 1
        return node

    def postfix(self):
        return self.postfix_ops(self.primary())

    def postfix_ops(self, node):
        while True:
            kind, value = self.peek()
            if kind == "op" and value == "!":
                self.take()
                node = ("fn", "factorial", (node,))
            elif kind in ("deg", "pct"):
                self.take()
                node = (kind, node)
            else:
                return node

    def group(self, opener: str, closer: str):
        self.expect(opener)
        found = self.items((closer,), expand=False)
        self.expect(closer)
        if len(found) != 1:
            if not found:
                raise AnswerError("parse_error")
            return ("list", tuple(found))
        return found[0]

    # ------------------------------------------------------------------ atoms
    def primary(self):
        self.enter()
        node = self._primary()
        self.depth -= 1
        return node

    def _primary(self):
        kind, value = self.take()
        if kind == "num":
            return self.number(value)
        if kind == "id":
            return ("const", value) if value in ("e", "i") else ("sym", value)
        if kind == "const":
            return _CONSTANTS[value]
        if kind == "fn":
            return self.function(value)
        if kind == "text":
            words = value
            while self.peek()[0] == "text":
                words += " " + self.take()[1]
            return text_node(words)
        if kind == "begin":
            return self.matrix(value)
        if kind != "op":
            raise AnswerError("parse_error")
        if value in ("(", "["):
            return self.bracketed(value)
        if value == "{":
            self.at -= 1
            return self.group("{", "}")
        if value == "\\{":
            if self.set_builder_ahead():
                return self.set_builder()
            found = self.items(("\\}",), expand=True)
            self.expect("\\}")
            return ("set", tuple(found)) if found else ("empty",)
        if value == "langle":
            found = self.items(("rangle",), expand=False)
            self.expect("rangle")
            return ("tuple", tuple(found))
        if value == "|":
            self.abs_open += 1
            inner = self.expr()
            self.expect("|")
            self.abs_open -= 1
            return ("fn", "abs", (inner,))
        if value in ("lfloor", "lceil"):
            inner = self.expr()
            self.expect("rfloor" if value == "lfloor" else "rceil")
            return ("fn", "floor" if value == "lfloor" else "ceiling", (inner,))
        raise AnswerError("parse_error")

    def set_builder_ahead(self) -> bool:
        """After `\\{`: `x |`, `x :` or `x \\in \\mathbb{R} |` opens a set of reals by a condition."""
        name, mark = self.peek(), self.peek(1)
        if mark == ("op", "in") and self.peek(2) == ("const", "reals"):
            mark = self.peek(3)
        return name[0] == "id" and mark in (("op", "|"), ("op", ":"))

    def set_builder(self):
        """\\{x | x > 2\\} is x > 2; conditions joined by "or" are a union (a list of them)."""
        self.at += 4 if self.peek(1) == ("op", "in") else 2
        conditions = [self.item()]
        while self.is_op("or"):
            self.take()
            conditions.append(self.item())
        self.expect("\\}")
        if any(c[0] != "rel" for c in conditions):
            raise AnswerError("parse_error")
        return conditions[0] if len(conditions) == 1 else ("list", tuple(conditions))

    def number(self, text: str):
        value = parse_number(text)
        if text.isdigit() and not self.in_exponent and self.peek() == ("fn", "frac"):  # 2\frac{1}{2}: a mixed number?
            start = self.at
            self.take()
            num, den = self.argument(), self.argument()
            if num[0] == den[0] == "num" and 0 < num[1] < den[1] and num[1].denominator == den[1].denominator == 1:
                return ("num", value + num[1] / den[1])
            self.at = start
        return ("num", value)

    def bracketed(self, opener: str):
        found = self.items((")", "]"), expand=False)
        closer = self.take()[1]
        if closer not in (")", "]"):
            raise AnswerError("parse_error")
        if len(found) == 1 and (opener + closer) in ("()", "[]"):
            return found[0]
        if len(found) == 2 and opener + closer != "()":
            return ("interval", found[0], found[1], opener == "(", closer == ")")
        if len(found) >= 2 and (opener + closer) in ("()", "[]"):
            return ("tuple", tuple(found))
        raise AnswerError("parse_error")

    def argument(self):
        """One argument of \\frac, \\sqrt, \\binom: a {group} or a single token (\\frac12)."""
        kind, value = self.peek()
        if kind == "op" and value == "{":
            return self.group("{", "}")
        if kind == "num" and len(value) > 1 and value[0].isdigit():
            self.tokens[self.at] = ("num", value[1:])
            return ("num", Fraction(int(value[0])))
        return self.primary()

    def function(self, name: str):
        if name == "frac":
            return ("div", self.argument(), self.argument())
        if name == "binom":
            return ("fn", "binom", (self.argument(), self.argument()))
        if name == "sqrt":
            index = None
            if self.is_op("["):
                self.take()
                index = self.expr()
                self.expect("]")
            radicand = self.group("(", ")") if self.is_op("(") else self.argument()
            return ("fn", "sqrt", (radicand,)) if index is None else ("fn", "root", (radicand, index))
        base = None
        if self.peek()[0] == "base":
            base = parse_answer(self.take()[1])
        power = None
        if self.is_op("^"):
            self.take()
            power = self.exponent()
            if power == ("neg", ("num", Fraction(1))) and name in _INVERSE:
                name, power = _INVERSE[name], None
        arg = self.function_argument()
        if name in ("ln", "lg"):
            name, base = "log", (("num", Fraction(10)) if name == "lg" else None)
        node: tuple = ("fn", name, (arg,) if base is None else (arg, base))
        if power is not None:
            node = ("pow", node, power)
        if self.is_op("^"):
            self.take()
            node = ("pow", node, self.exponent())
        return node

    def function_argument(self):
        """\\sin(x), \\sin{x}, or the factors up to the next operator: \\sin 2x, \\log_2 8."""
        if self.is_op("("):
            self.take()
            node = self.expr()
            self.expect(")")
            return node
        if self.is_op("{"):
            return self.group("{", "}")
        node = self.power()
        while self.starts_operand() and self.peek()[0] != "fn" and not self.is_op("(", "\\{"):
            node = _mul(node, self.power())
        return node

    def matrix(self, env: str):
        if env not in _MATRICES:
            raise AnswerError("unsupported_latex")
        rows: list[list] = [[]]
        while True:
            kind, value = self.peek()
            if kind == "end":
                self.take()
                break
            if kind == "end_of_input":
                raise AnswerError("parse_error")
            rows[-1].append(self.item())
            if self.is_op("&"):
                self.take()
            elif self.is_op("\\\\"):
                self.take()
                if self.peek()[0] != "end":
                    rows.append([])
            elif self.peek()[0] != "end":
                raise AnswerError("parse_error")
        if not rows[0] or any(len(row) != len(rows[0]) for row in rows):
            raise AnswerError("parse_error")
        return ("matrix", tuple(tuple(row) for row in rows))


def _mul(a, b):
    factors = (a[1] if a[0] == "mul" else (a,)) + (b[1] if b[0] == "mul" else (b,))
    return ("mul", factors)


def text_node(words: str):
    """Answer words, case- and punctuation-folded; 'no solution' is the empty set, 'all real
    numbers' the real line."""
    letters = [x for x in re.sub(r"[\s,;()]+", " ", words).strip().split(" ") if x.lower() not in ("and", "or")]
    if len(letters) > 1 and all(len(x) == 1 and x.isalpha() for x in letters):
        return ("list", tuple(("sym", x.upper()) for x in letters))  # \text{A, C, E}: choices
    folded = " ".join(re.sub(r"[.,;:!?\"']", " ", words).lower().split())
    if folded in ("infinity", "inf", "positive infinity"):
        return INFINITY
    if folded in _NUMBER_WORDS:
        return ("num", Fraction(_NUMBER_WORDS[folded]))
    if folded in _EMPTY_WORDS:
        return ("empty",)
    if folded in _REAL_WORDS:
        return REALS
    return ("text", folded)


def is_node(x) -> bool:
    return isinstance(x, tuple) and len(x) > 0 and isinstance(x[0], str) and x[0] in KINDS


def _map_part(part, fn):
    if is_node(part):
        return fn(part)
    if isinstance(part, tuple) and part and isinstance(part[0], tuple):  # items, or matrix rows
        return tuple(_map_part(p, fn) for p in part)
    return part


def map_children(node, fn):
    """The node with fn applied to each child node (inside tuples of items and rows too)."""
    return (node[0],) + tuple(_map_part(part, fn) for part in node[1:])


def child_nodes(node) -> list:
    """The node's child nodes, in order (inside tuples of items and rows too)."""
    found: list = []

    def keep(child):
        found.append(child)
        return child

    map_children(node, keep)
    return found


def _has_pm(node) -> bool:
    if not is_node(node):
        return False
    if node[0] in ("pm", "mp"):
        return True
    return any([_has_pm(child) for child in child_nodes(node)])


def _choose(node, sign: int):
    if node[0] in ("pm", "mp"):
        s = sign if node[0] == "pm" else -sign
        right = _choose(node[2], sign)
        right = right if s > 0 else ("neg", right)
        return right if node[1] is None else ("add", (_choose(node[1], sign), right))
    return map_children(node, lambda child: _choose(child, sign))


def expand_pm(node) -> list:
    """a ± b → [a + b, a − b] (every ± of one item takes the same sign, ∓ the other)."""
    return [_choose(node, +1), _choose(node, -1)] if _has_pm(node) else [node]


def parse_answer(cleaned: str):
    """The answer tree of a cleaned answer string."""
    for _ in range(3):  # {(C) 12}: a group around the whole answer (deeper nesting is the parser's)
        if cleaned.startswith("{") and matching_brace(cleaned, 0) == len(cleaned) - 1:
            cleaned = cleaned[1:-1].strip()
    choice = _CHOICE.fullmatch(cleaned)
    if choice:
        letter = choice.group(1) or choice.group(2) or choice.group(4)
        rest = choice.group(3)
        return ("choice", letter, parse_answer(rest) if rest else None)
    parser = _Parser(tokenize(cleaned))
    found = parser.items((), expand=True)
    if parser.peek() != _END or not found:
        raise AnswerError("parse_error")
    return found[0] if len(found) == 1 else ("list", tuple(found))
