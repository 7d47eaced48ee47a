"""The code verifier: a response's Python solution run against its record's tests in the
sandbox (megatron_rlvr.rewards.runner). Tests come as datasets store them:

- stdin/stdout (APPS, TACO, CodeContests, PRIME): {"inputs": [...], "outputs": [...]} or a
  list of {"input", "output"}; the printed output must match, token by token (numbers within
  1e-6 relative);
- function calls (APPS call-based, LeetCode): {"fn_name": f, "inputs": [[args], ...],
  "outputs": [...]}: f(*args) (or Solution().f) must return the output;
- assert-style (MBPP, HumanEval): a string of test code, a list of assert statements
  ({"test_list": [...]} too), or {"test": code, "entry_point": f} with a HumanEval check().

Any of these may also arrive as a JSON string (verl keeps them so in reward_model.ground_truth).
Reward: 1.0 when every test passes, else 0.0 (or the fraction passed, verifier.code.reward).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from megatron_rlvr.errors import UserError
from megatron_rlvr.rewards.reasoning import strip_reasoning
from megatron_rlvr.rewards.verdict import Verdict


class CodeTestError(UserError, ValueError):
    """A record's tests are in no shape the verifier knows."""


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
        return [{"kind": "assert", "code": tests}]
    if isinstance(tests, dict):
        if "inputs" in tests or "outputs" in tests:
            parsed = _io_tests(tests.get("inputs"), tests.get("outputs"), tests.get("fn_name"))
        elif "test_list" in tests:
            setup = "\n".join(
                filter(None, [tests.get("test_imports") and _text(tests["test_imports"]), tests.get("test_setup_code")])
            )
            parsed = [{"kind": "assert", "code": f"{setup}\n{t}" if setup else str(t)} for t in tests["test_list"]]
        elif "test" in tests:
            code = str(tests["test"])
            if tests.get("entry_point"):
                code += f"\ncheck({tests['entry_point']})"
            parsed = [{"kind": "assert", "code": code}]
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
                parsed.append({"kind": "assert", "code": item})
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
    return json.loads(json.dumps(value, default=repr))  # tuples → lists, as the sandbox returns them


def judge(test: dict, outcome: dict) -> str:
    """One test's verdict from what the sandbox reports: "passed" or why not."""
    status = outcome.get("status", "crashed")
    if test["kind"] == "stdio" and status == "ran":
        return "passed" if _tokens_match(outcome.get("output", ""), test["expected"]) else "wrong_answer"
    if test["kind"] == "call" and status == "returned":
        expected, value = _normal(test["expected"]), outcome.get("value")
        single = isinstance(expected, list) and len(expected) == 1 and value == expected[0]  # APPS wraps outputs
        return "passed" if value == expected or single else "wrong_answer"
    return status


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
        jobs = [
            {"code": code, "tests": [{k: v for k, v in t.items() if k != "expected"} for t in cases]}
            for code in codes
            if code.strip()
        ]
        from megatron_rlvr.rewards.runner import run_jobs

        answers = iter(
            run_jobs(
                jobs,
                wall_s=self.timeout_s,
                memory_mb=self.memory_mb,
                output_bytes=self.output_bytes,
                parallel=self.parallel,
            )
        )
        verdicts = []
        for code in codes:
            if not code.strip():
                verdicts.append((0.0, "no_answer"))
                continue
            answer = next(answers)
            if "error" in answer:
                verdicts.append((0.0, answer["error"]["reason"]))
                continue
            results = [judge(t, o) for t, o in zip(cases, answer["tests"])]
            results += [results[-1]] * (len(cases) - len(results))  # tests skipped after a violation
            passed = sum(r == "passed" for r in results)
            reward = passed / len(cases) if self.reward == "fraction" else float(passed == len(cases))
            verdicts.append((reward, "passed" if passed == len(cases) else next(r for r in results if r != "passed")))
        return verdicts
