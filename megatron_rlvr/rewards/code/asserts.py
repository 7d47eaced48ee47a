"""Assert-style tests (MBPP `test_list`, HumanEval `check(candidate)`, stateful tests that build
objects or mutate inputs) split so that no verdict is made where the solution's code runs.

A test such as `x = [3, 1]; sort_in_place(x); assert sorted(f(x)) == g(2) and x == [1, 3]` is
parsed here (Python `ast`) into
- the steps the sandbox runs after the solution: the test's statements its calls need (`x = [3,
  1]`), statements that only call the solution (`sort_in_place(x)`, `s = Stack()`, `s.push(1)`),
  and, for every assert, the values of its calls under test in the order Python evaluates them:
  `f(x)`, `g(2)`, then `x` (a name the test handed to the solution as it is, not a copy, is
  read back where the test reads it, as Python would see it). A call under test is a call of
  the solution's (or a method, attribute or item of what it returned or was given); its
  arguments are its inputs. Nothing else is evaluated there, and the values come back as plain
  data (code.values);
- the judge program: the test with each call under test replaced by `_rlvr_value(i)`, the i-th
  value sent back: `assert sorted(_rlvr_value(0)) == _rlvr_value(1) and _rlvr_value(2) == [1, 3]`.
  Every comparison, operator and function of the test's own (sorted, len, isinstance,
  math.isclose) runs there, in a process that never ran the solution (or, for `value ==
  literal` and `assert value`, right here).
The solution's process sees no expected value: only the statements that compute its inputs.
Forms that cannot be judged so are refused (CodeTestError, one line naming the test line): a
call under test inside a loop, comprehension or lambda; one whose input the test computed from
the solution's results; the solution's function or object used as a value (`map(f, xs)`,
`len(stack)`); a call that Python might skip (`a or s.pop()`) in a test with state.
"""

from __future__ import annotations

import ast
import builtins
import copy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from megatron_rlvr.errors import UserError

PLACEHOLDER = "_rlvr_value"  # _rlvr_value(i): the i-th value the sandbox sent back
_BUILTINS = frozenset(dir(builtins))
_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.For, ast.While, ast.If, ast.With, ast.Try)


class CodeTestError(UserError, ValueError):
    """A record's tests are in no shape the verifier knows, or cannot be judged safely."""


class _Rename(ast.NodeTransformer):
    """check(candidate)'s parameter → the entry point's name."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self.new, node.ctx), node) if node.id == self.old else node


def _own_nodes(statements: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of statements, not those inside the functions and classes they define."""
    pending: list[ast.AST] = list(statements)
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, _NESTED):
            pending.extend(ast.iter_child_nodes(node))


def _inline_check(check: ast.FunctionDef, target: str) -> list[ast.stmt]:
    if not check.args.args:
        raise CodeTestError("check() takes no argument: nothing to pass the solution to")
    for node in _own_nodes(check.body):
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


def _reads(statement: ast.stmt) -> set[str]:
    """The names a statement reads: `x += 1` reads x too."""
    reads = _loads(statement)
    if isinstance(statement, ast.AugAssign):
        reads |= {getattr(_root(statement.target), "id", "")} - {""}
    return reads


def _refusal(statement: ast.stmt, why: str) -> CodeTestError:
    text = ast.unparse(statement).split("\n", 1)[0]
    return CodeTestError(f"test line {getattr(statement, 'lineno', 0)} `{text[:60]}{'...' * (len(text) > 60)}`: {why}")


def _root(node: ast.AST) -> ast.AST:
    """`s.items.pop(0)` → `s`: what a chain of attribute reads and calls starts from."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _writes(statement: ast.stmt) -> set[str]:
    """Names a statement binds or may change in place (`x[0] = 1`, `x.sort()`)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return _bound_names([statement])
    written: set[str] = set()
    for node in _own_nodes([statement]):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            written.add(node.id)
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
            written.add(getattr(_root(node), "id", ""))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            written.add(getattr(_root(node.func), "id", ""))
    return written - {""}


class _Splitter:
    """Walks the test's statements in order, knowing where each name's value lives: the test's
    own data (both sides have it), `child` (the solution may have made or changed it: read back
    from the sandbox where the test reads it) or `judged` (the judge computed it from the
    solution's values: the sandbox has no such value)."""

    def __init__(self, statements: list[ast.stmt], free: set[str], bound: set[str]):
        self.free, self.bound = free, bound
        # the test's modules, functions and classes stay the test's, whatever the solution is given
        definitions = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        self.data = bound - {
            name for s in statements for n in ast.walk(s) if isinstance(n, definitions) for name in _writes(n)
        }
        self.child: set[str] = set()
        self.judged: set[str] = set()
        self.produced: set[str] = set()  # bound to what a call under test returned
        self.aliases: dict[str, set[str]] = {}  # `b = a`: one object, two names
        loads = [n for s in statements for n in ast.walk(s) if isinstance(n, ast.Attribute)]
        self.receivers = {n.value.id for n in loads if isinstance(n.value, ast.Name)}
        self.steps: list[tuple[str, ast.AST]] = []  # ("test" | "exec" | "value", node), in order
        self.program: list[ast.stmt] = []
        self.values = 0  # value steps so far
        self.conditional: list[tuple[ast.stmt, ast.expr]] = []
        self.sources: dict[int, ast.stmt] = {}  # each statement as written, for refusals after it was split

    def _refuse(self, statement: ast.stmt, why: str) -> CodeTestError:
        return _refusal(self.sources.get(id(statement), statement), why)

    # ------------------------------------------------------------------ where names live
    def _group(self, name: str) -> set[str]:
        return self.aliases.get(name, {name})

    def _rebind(self, name: str) -> None:
        self._group(name).discard(name)
        self.aliases.pop(name, None)
        self.child -= {name}
        self.judged -= {name}
        self.produced -= {name}

    def _by_reference(self, node: ast.AST) -> set[str]:
        """The test's names whose objects a call under test is handed, so that the solution may
        change them: its arguments as they are (`x`, `[x, y]`, `x[0]`, `x.items`, `*x`), also in
        a nested call under test; not a copy or a value computed from them (`x[:]`, `list(x)`,
        `len(x)`, `x + [1]`)."""
        names: set[str] = set()
        pending: list[ast.AST] = []
        chain = node
        while isinstance(chain, (ast.Attribute, ast.Call, ast.Subscript)):
            if isinstance(chain, ast.Call):
                pending += [*chain.args, *(k.value for k in chain.keywords)]
            chain = chain.func if isinstance(chain, ast.Call) else chain.value
        while pending:
            arg = pending.pop()
            if isinstance(arg, ast.Name):
                names.add(arg.id)
            elif isinstance(arg, (ast.Starred, ast.Attribute, ast.NamedExpr)):
                pending.append(arg.value)
            elif isinstance(arg, ast.Subscript) and not isinstance(arg.slice, ast.Slice):
                pending.append(arg.value)
            elif isinstance(arg, (ast.List, ast.Tuple, ast.Set)):
                pending += arg.elts
            elif isinstance(arg, ast.Dict):
                pending += [*filter(None, arg.keys), *arg.values]
            elif isinstance(arg, ast.IfExp):
                pending += [arg.body, arg.orelse]
            elif isinstance(arg, ast.Call) and self._rooted(arg):
                names |= self._by_reference(arg)
        return names

    def _expose(self, names: set[str]) -> None:
        """Handed to the solution: from now on their values are read back from the sandbox."""
        for name in names & self.data:
            self.child |= self._group(name)
            self.judged -= self._group(name)

    def _judge_binds(self, names: set[str]) -> None:
        for name in names & self.data:
            self.child -= self._group(name)
            self.produced -= self._group(name)
            self.judged |= self._group(name)

    def _rooted(self, node: ast.AST) -> bool:
        """A call under test: a chain of calls, attribute reads and subscripts (its methods) on a
        name of the solution's or one it may have changed (`f(1)`, `Solution().twoSum(x)`,
        `s.pop()`, `nodes[0].val`, `x`)."""
        root = _root(node)
        return isinstance(root, ast.Name) and (root.id in self.free or root.id in self.child)

    def _settable(self, target: ast.expr) -> bool:
        """A target the sandbox may store into: a name, or a part of the solution's objects (the
        judge stores into the test's own: `d["k"] = f(1)`)."""
        if isinstance(target, (ast.Tuple, ast.List)):
            return all(map(self._settable, target.elts))
        if isinstance(target, ast.Starred):
            return self._settable(target.value)
        return isinstance(target, ast.Name) or self._rooted(target)

    def _touches(self, node: ast.AST) -> bool:
        reads = _reads(node) if isinstance(node, ast.stmt) else _loads(node)
        return bool(reads & (self.free | self.child))

    # ------------------------------------------------------------------ statements
    def statement(self, statement: ast.stmt) -> None:
        self.sources[id(statement)] = copy.deepcopy(statement)
        if not self._touches(statement):
            return self._test_statement(statement)
        if isinstance(statement, ast.Assert):
            statement.msg = None
            statement.test = self._expr(statement.test, statement, False, True)
            return self.program.append(statement)
        if isinstance(statement, ast.Expr) and self._rooted(statement.value):
            return self._exec(statement, statement.value, [])
        if (
            isinstance(statement, ast.Assign)
            and self._rooted(statement.value)
            and all(map(self._settable, statement.targets))
        ):
            return self._exec(statement, statement.value, statement.targets)
        if isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)):
            return self._mixed(statement)
        raise self._refuse(
            statement,
            f"a {type(statement).__name__.lower()} statement calls the solution or reads what it changed; only "
            "assert, assignment and expression statements can be judged outside the solution's process",
        )

    def _test_statement(self, statement: ast.stmt) -> None:
        """The test's own code: the judge runs it, and the sandbox too where the calls need it."""
        self.program.append(statement)
        written = _writes(statement)
        if _reads(statement) & self.judged:
            return self._judge_binds(written)
        rebound = {n.id for n in _own_nodes([statement]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if isinstance(statement, ast.AugAssign):  # `x += [1]` may change x in place: still the same object
            rebound = set()
        for name in (rebound if isinstance(statement, _STATEMENTS) else written) & self.bound:
            self._rebind(name)
        value = getattr(statement, "value", None)
        if isinstance(statement, ast.Assign) and isinstance(value, ast.Name) and value.id in self.bound:
            group = self._group(value.id) | {t.id for t in statement.targets if isinstance(t, ast.Name)}
            for name in group:
                self.aliases[name] = group
        self.steps.append(("test", statement))

    def _exec(self, statement: ast.stmt, value: ast.expr, targets: list[ast.expr]) -> None:
        """`sort_in_place(x)`, `s = Stack()`, `node.next = Node(2)`: run in the sandbox only."""
        self._check_call(value, statement)
        for name in sorted(_loads(statement) & self.judged):
            raise self._judged_input(statement, name)
        self.steps.append(("exec", statement))
        self._expose(self._by_reference(value))
        for target in targets:
            for node in ast.walk(target):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    self._rebind(node.id)
                    self.child |= {node.id}
                    self.produced |= {node.id}

    def _mixed(self, statement: ast.stmt) -> None:
        """`r = f(1) + 1`: its calls under test read in the sandbox, the rest computed by the judge."""
        targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
        for target in filter(None, targets):
            names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if names & (self.free | self.child):
                raise self._refuse(statement, "the test stores into something of the solution's or that it changed")
        if getattr(statement, "value", None) is not None:
            statement.value = self._expr(statement.value, statement, False, False)  # type: ignore[attr-defined]
        self.program.append(statement)
        self._judge_binds(_writes(statement))

    # ------------------------------------------------------------------ expressions
    def _expr(self, node: ast.expr, statement: ast.stmt, conditional: bool, failsafe: bool) -> ast.expr:
        """node with each call under test replaced by its placeholder. `conditional`: Python may
        skip it; `failsafe`: Python skips it only where the assert fails anyway."""
        if self._rooted(node):
            return self._leaf(node, statement, conditional)
        if isinstance(node, _SCOPES):
            if not isinstance(node, ast.Lambda):  # the first iterable is read where the comprehension is
                node.generators[0].iter = self._expr(node.generators[0].iter, statement, conditional, False)
            if self._touches(node):
                raise self._refuse(
                    statement,
                    "a comprehension or lambda calls the solution or reads what it changed: the judge would run "
                    "it, so it cannot be judged outside the solution's process",
                )
            return node
        if isinstance(node, ast.BoolOp):
            keep = failsafe and isinstance(node.op, ast.And)
            node.values = [
                self._expr(v, statement, conditional or (i > 0 and not keep), keep) for i, v in enumerate(node.values)
            ]
        elif isinstance(node, ast.Compare):
            node.left = self._expr(node.left, statement, conditional, False)
            node.comparators = [
                self._expr(c, statement, conditional or (i > 0 and not failsafe), False)
                for i, c in enumerate(node.comparators)
            ]
        elif isinstance(node, ast.IfExp):
            node.test = self._expr(node.test, statement, conditional, False)
            node.body = self._expr(node.body, statement, True, False)
            node.orelse = self._expr(node.orelse, statement, True, False)
        elif isinstance(node, ast.NamedExpr):
            node.value = self._expr(node.value, statement, conditional, False)
            self._judge_binds({node.target.id})
        else:
            self._children(node, statement, conditional)
        return node

    def _children(self, node: ast.AST, statement: ast.stmt, conditional: bool) -> ast.AST:
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, self._expr(value, statement, conditional, False))
            elif isinstance(value, ast.AST):
                self._children(value, statement, conditional)
            elif isinstance(value, list):
                setattr(node, field, [self._item(v, statement, conditional) for v in value])
        return node

    def _item(self, value: Any, statement: ast.stmt, conditional: bool) -> Any:
        if isinstance(value, ast.expr):
            return self._expr(value, statement, conditional, False)
        return self._children(value, statement, conditional) if isinstance(value, ast.AST) else value

    def _leaf(self, node: ast.expr, statement: ast.stmt, conditional: bool) -> ast.expr:
        """A call under test: a value step for the sandbox, a placeholder for the judge."""
        if isinstance(node, ast.Name) and node.id in self.free:
            raise self._refuse(
                statement,
                f"the solution's {node.id!r} is used as a value, not called: only what its calls return can be "
                "judged outside its process",
            )
        if isinstance(node, ast.Name) and node.id in self.produced and node.id in self.receivers:
            raise self._refuse(
                statement,
                f"{node.id!r} holds an object of the solution's (the test uses its methods) and is used here as a "
                "value: only what its methods return can be judged outside its process",
            )
        self._check_call(node, statement)
        inputs = _loads(node) - _bound_names([node])
        for name in sorted(inputs & self.judged):
            raise self._judged_input(statement, name)
        if conditional:
            self.conditional.append((statement, node))
        self.steps.append(("value", node))
        self._expose(self._by_reference(node))
        placeholder = ast.Call(ast.Name(PLACEHOLDER, ast.Load()), [ast.Constant(self.values)], [])
        self.values += 1
        return ast.copy_location(placeholder, node)

    def _check_call(self, node: ast.expr, statement: ast.stmt) -> None:
        """`np.allclose(f(x), y)` with no `np` of the test's: a call that is handed the solution's
        results and is not the solution's own would judge them in its process."""
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            return
        func, root = node.func, node.func.value
        while isinstance(root, ast.Attribute):  # `np.testing.assert_equal`; not `Solution().merge`
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.free:
            arguments = [*node.args, *node.keywords]
            if any(self._rooted(n) for a in arguments for n in ast.walk(a)):
                raise self._refuse(
                    statement,
                    f"{ast.unparse(func)}() is given what the solution returned, and {root.id!r} is no module the "
                    "test imports: the call would judge those values in the solution's process",
                )

    def _judged_input(self, statement: ast.stmt, name: str) -> CodeTestError:
        return self._refuse(
            statement,
            f"the solution is given {name!r}, which the test computes from the solution's results (or in a loop "
            "or comprehension); it cannot be judged outside the solution's process",
        )

    # ------------------------------------------------------------------ results
    def sandbox_steps(self) -> list[list[str]]:
        """What the sandbox runs: the test's own statements only where a later step needs them."""
        needed: set[str] = set()
        steps: list[list[str]] = []
        for kind, node in reversed(self.steps):
            if kind == "test" and not (_writes(node) & needed):  # type: ignore[arg-type]
                continue
            steps.append(["value" if kind == "value" else "exec", ast.unparse(node)])
            needed |= _loads(node)
        return steps[::-1]

    def check_conditionals(self) -> None:
        stateful = any(kind == "exec" for kind, _ in self.steps)
        for statement, node in self.conditional:
            if stateful or _loads(node) & self.data:
                raise self._refuse(
                    statement,
                    f"{ast.unparse(node)} runs only when the test's condition lets it; the sandbox would run it "
                    "regardless, which could change what the test checks later",
                )


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _placeholder_index(node: ast.expr) -> int | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == PLACEHOLDER:
        return int(node.args[0].value)  # type: ignore[attr-defined]
    return None


def _inert(statement: ast.stmt) -> bool:
    """A statement that cannot change a quick check's outcome: an import (the sandbox ran it
    first), `NAME = literal` (HumanEval's METADATA, a test's input), `assert <true literal>`."""
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
    """A test's code → {"kind": "assert", "steps", "count", "program", "checks"}; raises
    CodeTestError for tests that cannot be judged outside the solution's process."""
    try:
        module = ast.parse(code)
    except (SyntaxError, ValueError) as err:
        raise CodeTestError(f"the test code does not parse: {err}") from None
    statements = _flatten(module, entry_point)
    statements = [ast.Import([ast.alias(name)]) for name in _unimported_modules(statements)] + statements
    bound = _bound_names(statements)
    free = {n for s in statements for n in _loads(s)} - bound - _BUILTINS
    splitter = _Splitter(statements, free, bound)
    for statement in statements:
        splitter.statement(statement)
    splitter.check_conditionals()
    steps, count = splitter.sandbox_steps(), splitter.values
    if not any(kind == "exec" for kind, _ in splitter.steps) and not count:
        raise CodeTestError("the test never calls the solution")
    program = splitter.program
    checks = [_fast_check(s) for s in program if not _inert(s)]
    judge_program = ast.unparse(ast.Module(program, []))
    try:
        compile(judge_program, "<test>", "exec")
    except SyntaxError as err:
        raise CodeTestError(f"the test does not compile once split: {err.msg}") from None
    return {
        "kind": "assert",
        "steps": steps,
        "count": count,
        "program": judge_program,
        "checks": None if None in checks else checks,
    }
