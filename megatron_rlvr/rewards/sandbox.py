"""Sympy equivalence checks of model answers in killable worker processes.

Model output is untrusted: sympy's parser evaluates Python, and simplification of a crafted
expression (a power tower, a huge factorial) can take unbounded time and memory. So the
comparison runs in child processes (`python -m megatron_rlvr.rewards.sandbox`) with an
address-space limit, a whitelisted character set, no builtins, and a parent that kills a
worker past its deadline and starts a fresh one. The caller never waits longer than the
timeout and never sees an exception.
"""

from __future__ import annotations

import cmath
import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from megatron_rlvr.rewards.math_text import AnswerError, latex_to_expr, structure

# ============================================================================ worker side
_SAFE_EXPR = re.compile(r"^[0-9A-Za-z+\-*/().,! ]*$")
_BAD_DOT = re.compile(r"\.(?!\d)")
_BIG_FACTORIAL = re.compile(r"\d{4,}\s*!")  # sympy evaluates factorial(n) while parsing
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 1_000
MAX_START_FAILURES = 3


def _sympy_namespace() -> dict:
    import sympy

    names = (
        "Integer Float Rational Symbol Function Add Mul Pow factorial sqrt root pi oo E I "
        "log exp sin cos tan cot sec csc asin acos atan"
    ).split()
    namespace = {name: getattr(sympy, name) for name in names}
    namespace["__builtins__"] = {}
    return namespace


def _guard_size(expr) -> None:
    """Refuses expressions whose evaluation would explode (9^9^9^9, 10^6!) before sympy
    tries: the timeout would catch them too, but only after burning the whole budget."""
    import sympy

    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp.is_number and node.base.is_number:
            try:
                exponent = abs(complex(node.exp.evalf(15)))
            except (OverflowError, TypeError, ValueError):
                raise AnswerError("too_large")
            if exponent > MAX_EXPONENT and abs(complex(node.base.evalf(15))) not in (0.0, 1.0):
                raise AnswerError("too_large")
        if isinstance(node, sympy.factorial) and node.args[0].is_number:
            if abs(complex(node.args[0].evalf(15))) > MAX_FACTORIAL:
                raise AnswerError("too_large")


def _to_sympy(text: str, namespace: dict):
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    code = latex_to_expr(text)
    if not _SAFE_EXPR.match(code) or _BAD_DOT.search(code):
        raise AnswerError("unsafe_input")
    if _BIG_FACTORIAL.search(code):
        raise AnswerError("too_large")
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    try:
        lazy = parse_expr(code, local_dict={}, global_dict=dict(namespace),
                          transformations=transformations, evaluate=False)
        _guard_size(lazy)
        return parse_expr(code, local_dict={}, global_dict=dict(namespace),
                          transformations=transformations)
    except AnswerError:
        raise
    except Exception:
        raise AnswerError("parse_error")


def _expr_equal(a: str, b: str, namespace: dict) -> bool:
    import sympy

    ea, eb = _to_sympy(a, namespace), _to_sympy(b, namespace)
    if ea == eb:
        return True
    if not ea.free_symbols and not eb.free_symbols:
        va, vb = complex(sympy.N(ea, 30)), complex(sympy.N(eb, 30))
        if not (cmath.isfinite(va) and cmath.isfinite(vb)):
            return va == vb
        return abs(va - vb) <= 1e-9 * max(1.0, abs(va), abs(vb))
    if sympy.simplify(ea - eb) == 0:
        return True
    return ea.equals(eb) is True


def _unordered_equal(xs: list, ys: list, namespace: dict) -> bool:
    if len(xs) != len(ys):
        return False
    remaining = list(ys)
    for x in xs:
        match = next((i for i, y in enumerate(remaining) if _structure_equal(x, y, namespace)), None)
        if match is None:
            return False
        remaining.pop(match)
    return True


def _structure_equal(a: tuple, b: tuple, namespace: dict) -> bool:
    # "(1, 2)" reads as a tuple, but equals the open interval (1, 2)
    if a[0] == "tuple" and b[0] == "interval" or a[0] == "interval" and b[0] == "tuple":
        tup, itv = (a, b) if a[0] == "tuple" else (b, a)
        if len(tup[1]) != 2 or not (itv[3] and itv[4]):
            return False
        return all(t[0] == "expr" for t in tup[1]) and _structure_equal(
            ("interval", tup[1][0][1], tup[1][1][1], True, True), itv, namespace
        )
    if a[0] != b[0]:
        return False
    kind = a[0]
    if kind == "expr":
        return _expr_equal(a[1], b[1], namespace)
    if kind == "interval":
        return a[3:] == b[3:] and all(_expr_equal(x, y, namespace) for x, y in zip(a[1:3], b[1:3]))
    if kind == "tuple":
        return len(a[1]) == len(b[1]) and all(
            _structure_equal(x, y, namespace) for x, y in zip(a[1], b[1])
        )
    return _unordered_equal(a[1], b[1], namespace)  # set, list, union


def compare_answers(pred: str, gold: str, namespace: dict) -> tuple[bool, str]:
    """Worker-side verdict on two normalised answers → (equal, reason)."""
    try:
        equal = _structure_equal(structure(pred), structure(gold), namespace)
        return equal, "sympy_equal" if equal else "sympy_mismatch"
    except AnswerError as err:
        return False, err.reason
    except MemoryError:
        return False, "too_large"
    except RecursionError:
        return False, "too_deep"
    except Exception:
        return False, "sympy_error"


def _serve(memory_mb: int) -> None:
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing sympy prints can corrupt the protocol
    namespace = _sympy_namespace()
    protocol.write('{"ready": true}\n')
    for line in sys.stdin:
        task = json.loads(line)
        equal, reason = compare_answers(task["pred"], task["gold"], namespace)
        protocol.write(json.dumps({"equal": equal, "reason": reason}) + "\n")


# ============================================================================ parent side
@dataclass
class _Worker:
    proc: subprocess.Popen
    buffer: bytes = b""
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0
    replies: deque = field(default_factory=deque)

    def read(self) -> bool:
        """Reads what is available; False on EOF (the worker died)."""
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if message.get("ready"):
                self.ready = True
            else:
                self.replies.append(message)
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stdin.close()


class SandboxPool:
    """A fixed number of sympy worker processes, started on first use."""

    def __init__(self, num_workers: int = 2, memory_mb: int = 1024):
        self.num_workers = num_workers
        self.memory_mb = memory_mb
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._start_failures = 0  # workers that died before ready, in a row

    def _spawn(self) -> _Worker:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME")}
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_rlvr.rewards.sandbox", str(self.memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
        return _Worker(proc)

    def compare(self, pairs: list[tuple[str, str]], timeout_s: float) -> list[tuple[bool, str]]:
        """Verdicts for (pred, gold) pairs of normalised answers; each pair gets at most
        `timeout_s` of a worker's time, counted from when a ready worker takes it."""
        with self._lock:
            self._start_failures = 0
            while len(self._workers) < min(self.num_workers, max(1, len(pairs))):
                self._workers.append(self._spawn())
            return self._run(pairs, timeout_s)

    def _run(self, pairs, timeout_s):
        results: list[tuple[bool, str] | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        with selectors.DefaultSelector() as selector:
            for worker in self._workers:
                selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
            while pending or any(w.task is not None for w in self._workers):
                for worker in self._workers:
                    if worker.ready and worker.task is None and pending:
                        index = pending.popleft()
                        pred, gold = pairs[index]
                        worker.task, worker.deadline = index, time.monotonic() + timeout_s
                        worker.proc.stdin.write(
                            (json.dumps({"pred": pred, "gold": gold}) + "\n").encode()
                        )
                        worker.proc.stdin.flush()
                deadlines = [w.deadline for w in self._workers if w.task is not None]
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.05
                for key, _ in selector.select(timeout=wait):
                    worker = key.data
                    alive = worker.read()
                    while worker.replies and worker.task is not None:
                        reply = worker.replies.popleft()
                        results[worker.task] = (bool(reply["equal"]), reply["reason"])
                        worker.task = None
                    if not alive:
                        self._replace(worker, selector, results, "worker_died")
                now = time.monotonic()
                for worker in list(self._workers):
                    if worker.task is not None and now >= worker.deadline:
                        self._replace(worker, selector, results, "timeout")
                if self._start_failures >= MAX_START_FAILURES:
                    # workers cannot even start (broken env, memory limit): fail fast, never spin
                    while pending:
                        results[pending.popleft()] = (False, "sandbox_unavailable")
                    if not any(w.task is not None for w in self._workers):
                        break
        return results

    def _replace(self, worker: _Worker, selector, results, reason: str) -> None:
        self._start_failures = 0 if worker.ready else self._start_failures + 1
        if worker.task is not None:
            results[worker.task] = (False, reason)
        selector.unregister(worker.proc.stdout)
        worker.kill()
        fresh = self._spawn()
        self._workers[self._workers.index(worker)] = fresh
        selector.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                worker.kill()
            self._workers.clear()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
