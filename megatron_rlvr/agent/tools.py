"""Tools an episode's model may call: one base class, plain functions made into tools, the
shipped calculator and Python interpreter, and the pool that runs calls off the event loop.

A tool has a name, an OpenAI function schema and a call. A plain Python function becomes a
tool with its schema built from its signature (type hints → JSON types; parameters without a
default are required) and its docstring (first paragraph → description, a Google-style
`Args:` section → parameter descriptions). Keyword-only parameters (after `*`) are per-record
arguments: they are not in the schema, the model cannot set them, and each record supplies them
from `extra_info.tools_kwargs.<tool name>` (verl's layout: a dict of kwargs, or one with
`create_kwargs` / `execute_kwargs` whose contents are merged).

Tools are registered by name in the config: `calculator` and `python` are shipped, anything
else is `path.to.module:function_or_class` (a Tool subclass is instantiated with no arguments).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import operator
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, get_type_hints

from megatron_rlvr.errors import UserError


class ToolConfigError(UserError):
    """A tool named in agent.tools that cannot be loaded or has no usable schema."""


class ToolInfraError(RuntimeError):
    """The tool machinery itself failed (its pool is stuck, its sandbox cannot start): the
    episode is retried, and the group fails once the retries are spent."""


@dataclass
class ToolResult:
    """What one call gives back: the text the model sees, whether it was an error, and an
    optional reward the tool grants (aggregated with agent.reward_aggregator)."""

    text: str
    error: bool = False
    reward: float | None = None


class Tool:
    """Subclass and set name, description, parameters (a JSON schema object); implement call
    (sync: the pool runs it on one of its own threads) or acall (async, on the event loop). Raise ToolInfraError for a failure of the
    tool's own machinery; any other exception is shown to the model as an error."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema, as chat templates take it in `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def call(self, arguments: dict[str, Any], **record_kwargs: Any) -> str | ToolResult:
        raise NotImplementedError

    async def acall(self, arguments: dict[str, Any], **record_kwargs: Any) -> str | ToolResult:
        """Async tools override this (sync ones override call)."""
        raise NotImplementedError

    @property
    def is_async(self) -> bool:
        return type(self).acall is not Tool.acall


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a docstring with an optional `Args:` section."""
    doc = inspect.cleandoc(doc or "")
    head, _, args = doc.partition("\nArgs:\n")
    described: dict[str, str] = {}
    current = None
    for line in args.splitlines():
        if not line.strip() or (line and not line[0].isspace()):
            break  # the end of the Args section
        match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)", line)
        if match and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = match.group(1)
            described[current] = match.group(2).strip()
        elif current is not None:
            described[current] += " " + line.strip()
    return " ".join(head.split("\n\n")[0].split()), described


class FunctionTool(Tool):
    """A plain function (sync or async) as a tool; its schema from signature and docstring,
    or given."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, schema: dict | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        signature = inspect.signature(fn)
        self.record_params = {p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        if schema is not None:
            function = schema.get("function", schema)
            self.description, self.parameters = function.get("description", ""), function["parameters"]
            return
        description, described = _docstring(fn.__doc__ or "")
        try:
            hints = get_type_hints(fn)
        except (NameError, TypeError):
            hints = {}
        properties: dict[str, Any] = {}
        required = []
        for param in signature.parameters.values():
            if param.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY):
                continue
            prop: dict[str, Any] = {}
            if hints.get(param.name) in _JSON_TYPES:
                prop["type"] = _JSON_TYPES[hints[param.name]]
            if param.name in described:
                prop["description"] = described[param.name]
            properties[param.name] = prop
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        self.description = description
        self.parameters = {"type": "object", "properties": properties, "required": required}

    def _check(self, arguments: dict[str, Any]) -> str | None:
        allowed = set(self.parameters.get("properties", {}))
        unknown = sorted(set(arguments) - allowed)
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; {self.name} takes {', '.join(sorted(allowed)) or 'none'}"
        missing = [p for p in self.parameters.get("required", []) if p not in arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        return None

    def _kwargs(self, record_kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in record_kwargs.items() if k in self.record_params}

    def call(self, arguments: dict[str, Any], **record_kwargs: Any) -> str | ToolResult:
        problem = self._check(arguments)
        if problem:
            return ToolResult(problem, error=True)
        return self.fn(**arguments, **self._kwargs(record_kwargs))

    async def acall(self, arguments: dict[str, Any], **record_kwargs: Any) -> str | ToolResult:
        """An async function's call (a sync one's goes through call)."""
        problem = self._check(arguments)
        if problem:
            return ToolResult(problem, error=True)
        return await self.fn(**arguments, **self._kwargs(record_kwargs))

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


def as_tool(obj: Any, name: str | None = None) -> Tool:
    """A Tool from a Tool instance, a Tool subclass (made with no arguments) or a function."""
    if isinstance(obj, Tool):
        return obj
    if inspect.isclass(obj) and issubclass(obj, Tool):
        return obj()
    if callable(obj):
        return FunctionTool(obj, name=name)
    raise ToolConfigError(f"{obj!r} is neither a function nor a Tool")


# ---------------------------------------------------------------------------- the calculator
_MAX_EXPRESSION_CHARS = 200
_MAX_MAGNITUDE = 10**30
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("power too large")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > _MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str | ToolResult:
    """Evaluates an arithmetic expression (numbers, + - * / // % ** and parentheses).

    Args:
        expression: the expression, e.g. "12*(3+4)"
    """
    if not isinstance(expression, str):
        return ToolResult("error: expression must be a string", error=True)
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return ToolResult(f"error: expression longer than {_MAX_EXPRESSION_CHARS} characters", error=True)
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return ToolResult("error: division by zero", error=True)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as err:
        return ToolResult(f"error: {err}", error=True)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


# ---------------------------------------------------------------------------- the Python interpreter
class PythonTool(Tool):
    """Runs model-written Python in the sandbox the code verifier uses (rewards/runner.py: a
    confined, seccomp-filtered child with memory, CPU and output limits, that can read neither
    the data nor the network); returns what it printed, or why it failed."""

    name = "python"
    description = "Runs a Python program and returns what it printed to stdout."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print what you need"}},
        "required": ["code"],
    }

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 512, output_bytes: int = 16384):
        self.timeout_s, self.memory_mb, self.output_bytes = timeout_s, memory_mb, output_bytes

    def call(self, arguments: dict[str, Any], **record_kwargs: Any) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) - {"code"}:
            return ToolResult("error: python takes one argument, code (a string)", error=True)
        from megatron_rlvr.rewards.runner import run_jobs

        [answer] = run_jobs(
            [{"code": code, "tests": [{"kind": "stdio", "input": ""}]}],
            wall_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_bytes=self.output_bytes,
            parallel=1,
        )
        if "error" in answer:
            if answer["error"].get("reason") == "sandbox_error":
                raise ToolInfraError(f"the python sandbox failed: {answer['error'].get('detail', '')}")
            return ToolResult(f"error: {answer['error'].get('reason')}", error=True)
        [outcome] = answer["tests"]
        status = outcome.get("status")
        output = outcome.get("output", "")
        if status == "ran":
            return ToolResult(output)
        detail = outcome.get("detail") or outcome.get("error") or ""
        return ToolResult(f"{output}error: {status} {detail}".strip(), error=True)


SHIPPED: dict[str, Callable[[], Tool]] = {
    "calculator": lambda: FunctionTool(calculator),
    "python": PythonTool,
}


def load_tool(spec: str) -> Tool:
    """A shipped tool by name, or `path.to.module:attribute` (a function, a Tool subclass or
    instance)."""
    if spec in SHIPPED:
        return SHIPPED[spec]()
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ToolConfigError(
            f"agent.tools: {spec!r} is neither a shipped tool ({', '.join(SHIPPED)}) nor 'path.to.module:function'"
        )
    try:
        obj = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ToolConfigError(f"agent.tools: cannot load {spec!r} ({err})") from None
    return as_tool(obj)


def load_tools(specs: list[str]) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if not tool.name or tool.name in tools:
            raise ToolConfigError(f"agent.tools: {spec!r} has an empty or repeated name {tool.name!r}")
        tools[tool.name] = tool
    return tools


def record_kwargs(extra: dict[str, Any] | None, tool: str) -> dict[str, Any]:
    """A record's arguments for `tool`: extra_info.tools_kwargs.<tool> (verl's layout)."""
    entry = ((extra or {}).get("tools_kwargs") or {}).get(tool) or {}
    if not isinstance(entry, dict):
        return {}
    if "create_kwargs" in entry or "execute_kwargs" in entry:
        return {**(entry.get("create_kwargs") or {}), **(entry.get("execute_kwargs") or {})}
    return dict(entry)


# ---------------------------------------------------------------------------- running calls
class ToolPool:
    """Runs tool calls off the event loop: at most `workers` at once, each with a deadline
    and an output cap. A call that times out or raises is an error result (the model sees
    it); a call that cannot get a worker within `acquire_timeout_s` (every worker is held by a
    call that never returned) or raises ToolInfraError is a ToolInfraError."""

    def __init__(
        self,
        tools: dict[str, Tool],
        *,
        workers: int = 8,
        timeout_s: float = 30.0,
        max_chars: int = 4096,
        acquire_timeout_s: float | None = None,
    ):
        self.tools, self.timeout_s, self.max_chars = tools, timeout_s, max_chars
        self.acquire_timeout_s = acquire_timeout_s if acquire_timeout_s is not None else 4 * timeout_s + 10
        self._slots = asyncio.Semaphore(workers)
        # sync tools run on these threads, `workers` of them (asyncio's default executor has
        # min(32, cpus + 4): 6 on 2 cores, whatever agent.tool_workers says)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    async def run(self, name: str, arguments: dict[str, Any], extra: dict[str, Any] | None) -> tuple[ToolResult, float]:
        """(result, seconds the call ran)."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"error: no tool named {name!r} (tools: {', '.join(self.tools)})", error=True), 0.0
        try:
            await asyncio.wait_for(self._slots.acquire(), self.acquire_timeout_s)
        except TimeoutError:
            raise ToolInfraError(
                f"no tool worker came free within {self.acquire_timeout_s:.0f} s (every one held by a call)"
            ) from None
        started = time.monotonic()
        kwargs = record_kwargs(extra, name)
        call: asyncio.Future[str | ToolResult]
        if tool.is_async:
            call = asyncio.ensure_future(tool.acall(arguments, **kwargs))
        else:
            call = asyncio.get_running_loop().run_in_executor(self._threads, partial(tool.call, arguments, **kwargs))
        call.add_done_callback(lambda _: self._slots.release())  # a worker is free once its call ends
        try:
            value = await asyncio.wait_for(asyncio.shield(call), self.timeout_s)
        except TimeoutError:
            call.add_done_callback(_consume)
            return ToolResult(f"error: {name} timed out after {self.timeout_s:g} s", error=True), self.timeout_s
        except asyncio.CancelledError:  # the episode was cancelled (its group failed): the call runs out
            call.add_done_callback(_consume)
            raise
        except ToolInfraError:
            raise
        except Exception as err:  # the tool's own failure: the model sees it
            return ToolResult(f"error: {name} failed: {type(err).__name__}: {err}", error=True), (
                time.monotonic() - started
            )
        result = value if isinstance(value, ToolResult) else ToolResult(str(value))
        result.text = truncate(result.text, self.max_chars)
        return result, time.monotonic() - started

    def close(self) -> None:
        """No new calls; threads still running a call end when it returns."""
        self._threads.shutdown(wait=False, cancel_futures=True)


def _consume(task: asyncio.Future) -> None:
    """Reads a call's late outcome (after its deadline or its episode's cancellation) so that
    asyncio does not log it as unretrieved."""
    if not task.cancelled():
        task.exception()


def truncate(text: str, max_chars: int) -> str:
    """At most max_chars characters of text: its head and tail around a marker."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text) - max_chars} characters truncated]...\n"
    keep = max(max_chars - len(marker), 0)
    return text[: keep - keep // 2] + marker + text[len(text) - keep // 2 :] if keep else marker
