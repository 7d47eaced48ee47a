"""The code verifier: a response's Python solution run against its record's tests in the
sandbox (megatron_rlvr.rewards.runner). Tests come as datasets store them:

- stdin/stdout (APPS, TACO, CodeContests, PRIME): {"inputs": [...], "outputs": [...]} or a
  list of {"input", "output"}; the printed output must match, token by token (numbers within
  1e-6 relative);
- function calls (APPS call-based, LeetCode): {"fn_name": f, "inputs": [[args], ...],
  "outputs": [...]}: f(*args) (or Solution().f) must return the output;
- assert-style (MBPP, HumanEval): a string of test code, a list of assert statements
  ({"test_list": [...]} too), or {"test": code, "entry_point": f} with a HumanEval check().
  These are split (code.asserts) into the calls under test, which the sandbox evaluates (after
  the statements that build their inputs or the solution's objects), and the rest of the test,
  judged on their values by a process that never ran the solution; a test that cannot be split
  so (a loop over the solution's results, `len(stack)` of an object) is refused, never trusted.

Every verdict is made outside the process that ran the solution, from what it printed or
returned as plain data: a returned `int` subclass, or any object with its own `__eq__`, is
not a value (not_a_value). Any of these may also arrive as a JSON string (verl keeps them so
in reward_model.ground_truth). Reward: 1.0 when every test passes, else 0.0 (or the fraction
passed, verifier.code.reward).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from megatron_rlvr.rewards.code.asserts import CodeTestError, split_asserts
from megatron_rlvr.rewards.code.values import RecordedValues, ValueFailed, decode_value
from megatron_rlvr.rewards.reasoning import strip_reasoning
from megatron_rlvr.rewards.verdict import Verdict

FAILURES = frozenset(
    {
        "wrong_answer",
        "runtime_error",
        "syntax_error",
        "timeout",
        "memory",
        "sandbox_violation",
        "output_limit",
        "not_a_value",
        "crashed",
        "sandbox_error",
    }
)
_TO_SANDBOX = {"stdio": ("kind", "input"), "call": ("kind", "fn", "args"), "assert": ("kind", "steps")}


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _io_tests(inputs: Any, outputs: Any, fn_name: Any) -> list[dict]:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise CodeTestError("'inputs' and 'outputs' must be lists of the same length")
    if fn_name:
        tests = []
        for args, expected in zip(inputs, outputs):
            args = json.loads(args) if isinstance(args, str) else args
            tests.append(
                {
                    "kind": "call",
                    "fn": str(fn_name),
                    "args": args if isinstance(args, list) else [args],
                    "expected": expected,
                }
            )
        return tests
    return [{"kind": "stdio", "input": _text(i), "expected": _text(o)} for i, o in zip(inputs, outputs)]


def parse_tests(tests: Any) -> list[dict]:
    """The record's tests → [{"kind": "stdio"|"call"|"assert", ...}]; raises CodeTestError."""
    if isinstance(tests, str):
        try:
            decoded = json.loads(tests)
        except ValueError:
            decoded = None
        if isinstance(decoded, (dict, list)):
            return parse_tests(decoded)
        if not tests.strip():
            raise CodeTestError("no tests")
        return [split_asserts(tests)]
    if isinstance(tests, dict):
        if "inputs" in tests or "outputs" in tests:
            parsed = _io_tests(tests.get("inputs"), tests.get("outputs"), tests.get("fn_name"))
        elif "test_list" in tests:
            setup = "\n".join(
                filter(None, [tests.get("test_imports") and _text(tests["test_imports"]), tests.get("test_setup_code")])
            )
            parsed = [split_asserts(f"{setup}\n{t}" if setup else str(t)) for t in tests["test_list"]]
        elif "test" in tests:
            parsed = [split_asserts(str(tests["test"]), str(tests.get("entry_point") or "") or None)]
        elif "input" in tests and "output" in tests:
            parsed = [{"kind": "stdio", "input": _text(tests["input"]), "expected": _text(tests["output"])}]
        else:
            raise CodeTestError(
                f"an object with keys {sorted(tests)[:6]}: expected inputs/outputs, test_list, test or input/output"
            )
    elif isinstance(tests, list):
        parsed = []
        for item in tests:
            if isinstance(item, str):
                parsed.append(split_asserts(item))
            elif isinstance(item, dict) and "input" in item and "output" in item:
                parsed.append({"kind": "stdio", "input": _text(item["input"]), "expected": _text(item["output"])})
            else:
                raise CodeTestError("a list of tests must hold assert strings or {input, output} objects")
    else:
        raise CodeTestError(f"tests must be a string, object or list (got {type(tests).__name__})")
    if not parsed:
        raise CodeTestError("no tests")
    return parsed


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The solution in a response: its reasoning stripped, then the last ```python (or plain
    ```) block, else the whole text."""
    text = strip_reasoning(response)
    blocks = _FENCE.findall(text)
    python = [code for lang, code in blocks if lang.lower() in ("python", "python3", "py")]
    chosen = python or [code for lang, code in blocks if not lang]
    return chosen[-1] if chosen else text


def _tokens_match(got: str, expected: str) -> bool:
    a, b = got.split(), expected.split()
    if a == b:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-9):
            return False
    return True


def _normal(value: Any) -> Any:
    """JSON's view of a value (tuples as lists, keys as strings), as call tests store outputs."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):  # a set, a bytes: compared as it is
        return value


def _failure(outcome: Any) -> str:
    status = outcome.get("status") if isinstance(outcome, dict) else None
    return status if status in FAILURES else "crashed"


def _quick_verdict(checks: list, recorded: RecordedValues) -> str:
    """`assert v`, `assert not v`, `assert v == literal`, in order: the first that fails decides."""
    for op, index, expected in checks:
        try:
            value = recorded(index)
        except ValueFailed as failed:
            return _failure(failed.outcome)
        met = {"truthy": bool(value), "falsy": not value, "eq": value == expected, "ne": value != expected}[op]
        if not met:
            return "wrong_answer"
    return "passed"


def judge(test: dict, outcome: dict, judged: dict | None = None) -> str:
    """One test's verdict: "passed" or why not. `outcome` is what the solution's process
    reported (data: it may say anything, so "passed" is never taken from it); `judged` is the
    judge program's outcome for an assert test without quick checks."""
    status = outcome.get("status")
    if test["kind"] == "stdio" and status == "ran":
        return "passed" if _tokens_match(str(outcome.get("output", "")), test["expected"]) else "wrong_answer"
    if test["kind"] in ("call", "assert") and status == "returned":
        try:
            if test["kind"] == "call":
                value, expected = _normal(decode_value(outcome.get("value"))), _normal(test["expected"])
                # APPS wraps a call's output in a list of one
                single = isinstance(expected, list) and len(expected) == 1 and value == expected[0]
                return "passed" if value == expected or single else "wrong_answer"
            recorded = RecordedValues(outcome["values"], outcome.get("raised") or [])
            if len(recorded.values) != test["count"]:
                return "crashed"
            if test["checks"] is not None:
                return _quick_verdict(test["checks"], recorded)
        except (ValueError, TypeError, KeyError, RecursionError):
            return "crashed"
        if judged is None:
            return "crashed"
        status = judged.get("status")
        return "passed" if status == "passed" else _failure(judged)
    return status if status in FAILURES else "crashed"


class CodeVerifier:
    """Scores responses against a record's tests; the sandbox's supervisors are started per
    batch, so nothing stays running between batches."""

    def __init__(
        self, *, timeout_s: float, memory_mb: int, max_output_kb: int, reward: str = "all_pass", parallel: int = 2
    ):
        self.timeout_s, self.memory_mb, self.reward, self.parallel = timeout_s, memory_mb, reward, parallel
        self.output_bytes = max_output_kb * 1024

    def verify_batch(self, responses: list[str], tests: Any) -> list[Verdict]:
        """Verdicts of responses that answer the same record (its tests)."""
        cases = parse_tests(tests)
        codes = [extract_code(r) for r in responses]
        sandboxed = [{k: t[k] for k in _TO_SANDBOX[t["kind"]]} for t in cases]  # no expected side
        jobs = [{"code": code, "tests": sandboxed} for code in codes if code.strip()]
        from megatron_rlvr.rewards.runner import start_supervisors, stop_supervisors

        # the judges start while the solutions run; they are given no model code
        judging = any(t["kind"] == "assert" and t["checks"] is None for t in cases) and jobs
        judges = start_supervisors(min(self.parallel, len(jobs))) if judging else []
        try:
            answers = iter(self._run(jobs))
            outcomes: list[list[dict] | str] = []
            for code in codes:
                answer = next(answers) if code.strip() else {"error": {"reason": "no_answer"}}
                outcomes.append(answer["error"]["reason"] if "error" in answer else answer["tests"])
            judged = self._judge_programs(cases, outcomes, judges)
        finally:
            stop_supervisors(judges)  # those the judge programs did not need (the rest are done)
        verdicts = []
        for row, tested in enumerate(outcomes):
            if isinstance(tested, str):
                verdicts.append((0.0, tested))
                continue
            results = [judge(t, o, judged.get((row, i))) for i, (t, o) in enumerate(zip(cases, tested))]
            results += [results[-1]] * (len(cases) - len(results))  # tests skipped after a violation
            passed = sum(r == "passed" for r in results)
            reward = passed / len(cases) if self.reward == "fraction" else float(passed == len(cases))
            verdicts.append((reward, "passed" if passed == len(cases) else next(r for r in results if r != "passed")))
        return verdicts

    def _run(self, jobs: list[dict], started: list | None = None) -> list[dict]:
        from megatron_rlvr.rewards.runner import run_jobs

        return run_jobs(
            jobs,
            wall_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_bytes=self.output_bytes,
            parallel=self.parallel,
            started=started,
        )

    def _judge_programs(self, cases: list[dict], outcomes: list, judges: list) -> dict[tuple[int, int], dict]:
        """(response, test) → the outcome of the assert test's judge program on the values that
        response's code returned, run by supervisors that are given no model code."""
        where, jobs = [], []
        for row, tested in enumerate(outcomes):
            for index, (test, outcome) in enumerate(zip(cases, tested if isinstance(tested, list) else [])):
                if test["kind"] == "assert" and test["checks"] is None and outcome.get("status") == "returned":
                    where.append((row, index))
                    jobs.append(
                        {"judge": test["program"], "values": outcome.get("values"), "raised": outcome.get("raised")}
                    )
        answers = self._run(jobs, judges)  # a supervisor that died answers {"error": {"reason": ...}}
        return {at: a.get("outcome") or {"status": a.get("error", {}).get("reason")} for at, a in zip(where, answers)}
