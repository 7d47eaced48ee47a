"""Your own verifier: `function(response, record) -> float` from your module, named in
verifier.functions as 'module:function' or 'path/to/file.py:function'. It runs in the sandbox
(runner.py) like model-written code: one call per response in a confined child with the
verifier's time and memory limits. An exception, a timeout or a return that is not a number
is a 0 with its reason. The record is a dict: id, prompt, ground_truth, verifier,
data_source, extra_info; the response is the model's whole text (reasoning included:
megatron_rlvr.rewards.reasoning.strip_reasoning drops it).

Your module is imported once per batch before confinement, so it may import what it needs at
the top; the call itself has no network and can write only in a temporary directory. The
project's own functions (IN_PROCESS_MODULES: the long-answer task's) run in the verifier's
process instead, with the same verdicts."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from megatron_rlvr.errors import UserError
from megatron_rlvr.rewards.verdict import Verdict


class FunctionSpecError(UserError):
    """A verifier.functions entry that names no importable function."""


def resolve_function(spec: str, base_dir: str | Path) -> dict:
    """'module:function' or 'file.py:function' → what the sandbox's supervisor loads; file
    paths are made absolute against base_dir, the directory the run started in."""
    module, _, function = spec.rpartition(":")
    if module.endswith(".py") or "/" in module:
        module = str((Path(base_dir) / module).resolve())
    return {"module": module, "function": function, "search": [str(Path(base_dir).resolve())]}


def check_function(name: str, resolved: dict) -> None:
    """Finds the module's source and the function's definition in it without running it;
    raises FunctionSpecError naming verifier.functions.<name>."""
    where = f"verifier.functions.{name}"
    module, function = resolved["module"], resolved["function"]
    if module.endswith(".py"):
        source_path = Path(module)
        if not source_path.is_file():
            raise FunctionSpecError(f"{where}: no file {module}")
    else:
        import sys

        sys.path[:0] = [d for d in resolved["search"] if d not in sys.path]
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None or not found.origin or not found.origin.endswith(".py"):
            raise FunctionSpecError(
                f"{where}: no Python module {module!r} (searched {resolved['search'][0]} and the installed packages)"
            )
        source_path = Path(found.origin)
    try:
        tree = ast.parse(source_path.read_text(), str(source_path))
    except (OSError, SyntaxError) as err:
        raise FunctionSpecError(f"{where}: cannot read {source_path} ({err})") from None
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    if function not in defined:
        raise FunctionSpecError(f"{where}: {source_path} defines no {function!r}")


# the project's own verifier functions: our code, reading the response as text, so they run in
# the verifier's process (a sandbox supervisor per group cost 0.23 s of CPU on the learner's core
# in local mode, more than the check, with 11-26 groups verified a step on the long-answer task)
IN_PROCESS_MODULES = frozenset({"megatron_rlvr.rewards.long_answers"})


def function_verifier(resolved: dict, *, timeout_s: float, memory_mb: int) -> FunctionVerifier | InProcessFunction:
    """The verifier of one verifier.functions entry: in this process for the project's own
    (IN_PROCESS_MODULES), in the sandbox for every other."""
    if resolved["module"] in IN_PROCESS_MODULES:
        return InProcessFunction(resolved)
    return FunctionVerifier(resolved, timeout_s=timeout_s, memory_mb=memory_mb, parallel=1)


def _verdict(outcome: dict) -> Verdict:
    status = outcome.get("status") or outcome.get("reason", "sandbox_error")
    return (outcome["value"], "scored") if status == "scored" else (0.0, status)


class InProcessFunction:
    """A function of IN_PROCESS_MODULES, called here, with the sandbox's verdicts."""

    def __init__(self, resolved: dict):
        from megatron_rlvr.rewards.runner import load_function

        self.function = load_function(resolved)

    def verify_batch(self, responses: list[str], record: dict) -> list[Verdict]:
        from megatron_rlvr.rewards.runner import call_function

        return [_verdict(call_function(self.function, r, record, caught=Exception)) for r in responses]


class FunctionVerifier:
    """A user's function, called in the sandbox (runner.py), one confined child per response."""

    def __init__(self, resolved: dict, *, timeout_s: float, memory_mb: int, parallel: int = 2):
        self.resolved, self.timeout_s, self.memory_mb, self.parallel = resolved, timeout_s, memory_mb, parallel

    def verify_batch(self, responses: list[str], record: dict) -> list[Verdict]:
        from megatron_rlvr.rewards.runner import run_jobs

        answers = run_jobs(
            [{"response": r, "record": record} for r in responses],
            wall_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_bytes=1 << 20,
            parallel=self.parallel,
            function=self.resolved,
        )
        return [_verdict(answer.get("outcome") or answer["error"]) for answer in answers]
