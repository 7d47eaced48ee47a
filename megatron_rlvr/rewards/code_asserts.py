"""Assert-style tests (MBPP `test_list`, HumanEval `check(candidate)`) split so that no verdict
is made where the solution's code runs.

A test such as `assert abs(add(1, 2) - 3) < 1e-6` is parsed here (Python `ast`) into
- the calls under test, `add(1, 2)`: the parts that call the solution, with only inputs (their
  arguments) and built-in or imported functions in them. The sandbox evaluates just these, after
  the solution, and sends back their values as plain data (code_values);
- the judge program, `assert abs(_rlvr_value_0 - 3) < 1e-6`: the test with each call under test
  replaced by its value. It holds the expected side and is run by a process that never ran the
  solution (or, for `value == literal` and `assert value`, compared right here).
The solution's process never sees an expected value. A test whose calls under test depend on
what the test computed from the solution's results (loops over results, `x = f(); g(x)`) cannot
be split so, and is refused (CodeTestError) rather than judged where the solution could forge it.
"""

from __future__ import annotations

import ast
import builtins
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from megatron_rlvr.errors import UserError

PLACEHOLDER = "_rlvr_value_{}"
_BUILTINS = frozenset(dir(builtins))
_SPLITTABLE = (ast.Assert, ast.Expr, ast.Assign)


class CodeTestError(UserError, ValueError):
    """A record's tests are in no shape the verifier knows, or cannot be judged safely."""


class _Rename(ast.NodeTransformer):
    """check(candidate)'s parameter → the entry point's name."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self.new, node.ctx), node) if node.id == self.old else node


def _own_nodes(function: ast.FunctionDef) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the functions and classes it defines."""
    pending: list[ast.AST] = list(function.body)
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))


def _inline_check(check: ast.FunctionDef, target: str) -> list[ast.stmt]:
    if not check.args.args:
        raise CodeTestError("check() takes no argument: nothing to pass the solution to")
    for node in _own_nodes(check):
        if isinstance(node, (ast.Return, ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom)):
            raise CodeTestError(
                f"check() line {node.lineno}: a {type(node).__name__.lower()} statement cannot be judged"
            )
    renamer = _Rename(check.args.args[0].arg, target)
    return [renamer.visit(statement) for statement in check.body]


def _flatten(module: ast.Module, entry_point: str | None) -> list[ast.stmt]:
    """The test's statements with check(candidate)'s body inlined where it is called."""
    checks = {s.name: s for s in module.body if isinstance(s, ast.FunctionDef) and s.name == "check"}
    statements: list[ast.stmt] = []
    called = False
    for statement in module.body:
        if statement in checks.values():
            continue
        call = statement.value if isinstance(statement, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in checks:
            target = entry_point or (call.args[0].id if call.args and isinstance(call.args[0], ast.Name) else None)
            if target is None:
                raise CodeTestError(f"line {statement.lineno}: check() is called with no function name")
            statements += _inline_check(checks[call.func.id], target)
            called = True
        else:
            statements.append(statement)
    if entry_point and not checks:  # bare asserts on `candidate`
        statements = [_Rename("candidate", entry_point).visit(s) for s in statements]
    if checks and not called:
        if not entry_point:
            raise CodeTestError("the test defines check() but nothing calls it and no entry_point names the function")
        statements += _inline_check(checks["check"], entry_point)
    return statements


def _unimported_modules(statements: list[ast.stmt]) -> list[str]:
    """Standard modules a test uses (`math.isclose`) but forgot to import: they are the test's,
    not the solution's, so they are imported for it rather than looked up in the solution."""
    nodes = [n for s in statements for n in ast.walk(s)]
    attributes = {n.value.id for n in nodes if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    called = {n.func.id for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return sorted((attributes & sys.stdlib_module_names) - called - _bound_names(statements))


def _bound_names(nodes: Sequence[ast.AST]) -> set[str]:
    bound: set[str] = set()
    for top in nodes:
        for node in ast.walk(top):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                bound.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
    return bound


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


class _Splitter(ast.NodeTransformer):
    """Replaces the largest subexpressions that call the solution and hold no test data outside
    that call's arguments with placeholders; collects them."""

    def __init__(self, statements: list[ast.stmt], free: set[str], imported: set[str]):
        self.free, self.imported = free, imported
        self.taken: list[ast.expr] = []
        self.tainted: set[int] = set()  # ids of the nodes that call the solution, found in one pass
        self.clean: dict[int, bool] = {}
        for statement in statements:
            self._mark(statement)

    def _mark(self, node: ast.AST) -> bool:
        found = isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.free
        for child in ast.iter_child_nodes(node):
            found |= self._mark(child)
        if found:
            self.tainted.add(id(node))
        return found

    def calls_solution(self, node: ast.AST) -> bool:
        return id(node) in self.tainted

    def holds_no_test_data(self, node: ast.AST) -> bool:
        """Constants and the test's own names may appear only as arguments of a call to the
        solution (they are its inputs); elsewhere they could be the expected side."""
        if id(node) not in self.clean:
            if isinstance(node, ast.Constant):
                clean = False
            elif isinstance(node, ast.Name):
                clean = node.id in self.free or node.id in self.imported or node.id in _BUILTINS
            elif isinstance(node, ast.Call) and self.calls_solution(node.func):
                clean = self.holds_no_test_data(node.func)
            else:
                clean = all(self.holds_no_test_data(child) for child in ast.iter_child_nodes(node))
            self.clean[id(node)] = clean
        return self.clean[id(node)]

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and self.calls_solution(node) and self.holds_no_test_data(node):
            self.taken.append(node)
            return ast.copy_location(ast.Name(PLACEHOLDER.format(len(self.taken) - 1), ast.Load()), node)
        return super().generic_visit(node)


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _placeholder_index(node: ast.expr) -> int | None:
    if isinstance(node, ast.Name) and node.id.startswith("_rlvr_value_"):
        return int(node.id.rsplit("_", 1)[1])
    return None


def _inert(statement: ast.stmt) -> bool:
    """A statement that cannot change a quick check's outcome: an import (the sandbox ran it
    first), `NAME = literal` (HumanEval's METADATA), `assert <true literal>`."""
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(statement, ast.Assign):
        return all(isinstance(t, ast.Name) for t in statement.targets) and _literal(statement.value)[0]
    if isinstance(statement, ast.Assert):
        ok, value = _literal(statement.test)
        return ok and bool(value)
    return False


def _fast_check(statement: ast.stmt) -> tuple[str, int, Any] | None:
    """(op, value index, expected) for `assert v`, `assert not v`, `assert v ==/!= literal`."""
    if not isinstance(statement, ast.Assert):
        return None
    test = statement.test
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    index = _placeholder_index(test.operand if isinstance(test, ast.UnaryOp) and negated else test)
    if index is not None:
        return ("falsy" if negated else "truthy", index, None)
    if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], (ast.Eq, ast.NotEq)):
        return None
    op = "eq" if isinstance(test.ops[0], ast.Eq) else "ne"
    for side, other in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
        index = _placeholder_index(side)
        ok, expected = _literal(other)
        if index is not None and ok:
            return (op, index, expected)
    return None


def split_asserts(code: str, entry_point: str | None = None) -> dict:
    """A test's code → {"kind": "assert", "setup", "exprs", "program", "checks"}; raises
    CodeTestError for tests that cannot be judged outside the solution's process."""
    try:
        module = ast.parse(code)
    except (SyntaxError, ValueError) as err:
        raise CodeTestError(f"the test code does not parse: {err}") from None
    statements = _flatten(module, entry_point)
    statements = [ast.Import([ast.alias(name)]) for name in _unimported_modules(statements)] + statements
    bound = _bound_names(list(statements))
    free = {n for s in statements for n in _loads(s)} - bound - _BUILTINS
    imported = _bound_names([s for s in statements if isinstance(s, (ast.Import, ast.ImportFrom))])
    splitter = _Splitter(statements, free, imported)
    program: list[ast.stmt] = []
    setup: list[ast.stmt] = []
    judged = [s for s in statements if splitter.calls_solution(s)]
    # the names a call under test may use: the solution's, built-ins, and what the test's other
    # statements bind (the sandbox runs those first) but not what loops, comprehensions or the
    # solution's own results bind
    inputs = free | _BUILTINS | (_bound_names([s for s in statements if s not in judged]) - _bound_names(judged))
    exprs: list[list] = []
    for statement in statements:
        if not splitter.calls_solution(statement):
            program.append(statement)
            setup.append(statement)
            continue
        if not isinstance(statement, _SPLITTABLE):
            kind = type(statement).__name__.lower()
            raise CodeTestError(
                f"test line {statement.lineno}: a {kind} statement calls the solution; only assert, assignment "
                "and expression statements can be judged outside the solution's process"
            )
        if isinstance(statement, ast.Assert):
            statement.msg = None
        first, whole = len(splitter.taken), statement.value if isinstance(statement, ast.Expr) else None
        statement = splitter.visit(statement)
        for node in splitter.taken[first:]:
            unknown = sorted(_loads(node) - _bound_names([node]) - inputs)
            if unknown:
                raise CodeTestError(
                    f"test line {node.lineno}: the call under test uses {unknown[0]!r}, which the test binds in a "
                    "loop, a comprehension or from the solution's results; it cannot be judged outside its process"
                )
            exprs.append([ast.unparse(node), node is not whole])  # an expression statement's value is unused
        program.append(statement)
    if not exprs:
        raise CodeTestError("the test never calls the solution")
    needed = {n for source, _ in exprs for n in _loads(ast.parse(source, mode="eval"))}
    shared: list[ast.stmt] = []
    for statement in reversed(setup):  # what the calls under test need: imports, inputs, helpers
        if isinstance(statement, (ast.Import, ast.ImportFrom)) or _bound_names([statement]) & needed:
            shared.insert(0, statement)
            needed |= _loads(statement)
    checks = [_fast_check(s) for s in program if not _inert(s)]
    judge_program = ast.unparse(ast.Module(program, []))
    try:
        compile(judge_program, "<test>", "exec")
    except SyntaxError as err:
        raise CodeTestError(f"the test does not compile once split: {err.msg}") from None
    return {
        "kind": "assert",
        "setup": ast.unparse(ast.Module(shared, [])),
        "exprs": exprs,
        "program": judge_program,
        "checks": None if None in checks else checks,
    }
