"""Tools (agent/tools.py): schemas from functions, per-record arguments, the calculator's
bounds, the pool's output cap, and the python tool in the sandbox."""

import asyncio
import os
import threading
from pathlib import Path

import pytest

from megatron_rlvr.agent.tools import (
    FunctionTool,
    PythonTool,
    ToolConfigError,
    ToolPool,
    ToolResult,
    calculator,
    load_tool,
    load_tools,
    record_kwargs,
)


def lookup(query: str, k: int = 3, *, index: str = "default") -> str:
    """Searches the index for a query.

    Longer text that is not the description.

    Args:
        query: what to look for,
            possibly long
        k (int): how many hits
    """
    return f"{index}:{query}:{k}"


def test_a_function_becomes_a_tool_with_its_schema_and_per_record_arguments():
    tool = FunctionTool(lookup)
    assert tool.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Searches the index for a query.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for, possibly long"},
                    "k": {"type": "integer", "description": "how many hits"},
                },
                "required": ["query"],
            },
        },
    }
    extra = {"tools_kwargs": {"lookup": {"create_kwargs": {"index": "wiki"}}}}
    assert record_kwargs(extra, "lookup") == {"index": "wiki"} and record_kwargs(None, "lookup") == {}
    assert tool.call({"query": "moe"}, **record_kwargs(extra, "lookup")) == "wiki:moe:3"
    # the model can neither set a per-record argument nor pass unknown ones
    refused = tool.call({"query": "moe", "index": "secret"})
    assert isinstance(refused, ToolResult) and refused.error and "unknown argument(s) index" in refused.text
    assert "missing argument(s) query" in tool.call({}).text
    given = FunctionTool(lookup, name="find", schema={"description": "d", "parameters": {"type": "object"}})
    assert given.schema()["function"] == {"name": "find", "description": "d", "parameters": {"type": "object"}}


def test_tools_load_by_shipped_name_or_module_path():
    tools = load_tools(["calculator", f"{__name__}:lookup", "python"])
    assert list(tools) == ["calculator", "lookup", "python"] and isinstance(tools["python"], PythonTool)
    with pytest.raises(ToolConfigError, match="neither a shipped tool"):
        load_tool("nonsense")
    with pytest.raises(ToolConfigError, match="cannot load 'no.such.module:fn'"):
        load_tool("no.such.module:fn")
    with pytest.raises(ToolConfigError, match="repeated name"):
        load_tools(["calculator", "calculator"])


@pytest.mark.parametrize(
    "expression, shown",
    [
        ("12*(3+4)", "84"),
        ("7/2", "3.5"),
        ("2**10", "1024"),
        ("-3 + 10 // 4", "-1"),
        ("__import__('os').system('true')", "error: unsupported expression element: Call"),
        ("(1).__class__", "error: unsupported expression element: Attribute"),
        ("9**9**9", "error: power too large"),
        ("10**29*10**29", "error: result too large"),
        ("1/0", "error: division by zero"),
        ("1+" * 150 + "1", "error: expression longer than 200 characters"),
        ("2 +", "error: invalid syntax"),
    ],
)
def test_the_calculator_evaluates_arithmetic_only_and_bounded(expression, shown):
    result = calculator(expression)
    text = result.text if isinstance(result, ToolResult) else result
    assert text.startswith(shown)
    assert isinstance(result, ToolResult) == shown.startswith("error")


def test_the_pool_caps_output_and_names_unknown_tools():
    pool = ToolPool({"echo": FunctionTool(lambda text: text * 100, name="echo")}, max_chars=120)

    async def run():
        return await pool.run("echo", {"text": "abcdefghij"}, None), await pool.run("nope", {}, None)

    (long, _), (unknown, _) = asyncio.run(run())
    assert len(long.text) == 120 and "[880 characters truncated]" in long.text
    assert long.text.startswith("abcdefghij") and long.text.endswith("abcdefghij")
    assert unknown.error and "no tool named 'nope' (tools: echo)" in unknown.text


def test_the_pool_runs_as_many_sync_calls_at_once_as_it_has_workers():
    """40 blocking calls that can only finish together (a barrier of 40) all finish: each runs
    on a thread of the pool's own. On asyncio's default executor (min(32, cpus + 4) threads)
    the barrier breaks and every call is an error."""
    calls = 40
    barrier = threading.Barrier(calls, timeout=20)

    def wait_for_all() -> str:
        barrier.wait()
        return "ok"

    pool = ToolPool({"wait": FunctionTool(wait_for_all, name="wait")}, workers=calls, timeout_s=30)

    async def run():
        try:
            return await asyncio.gather(*(pool.run("wait", {}, None) for _ in range(calls)))
        finally:
            pool.close()

    assert [result.text for result, _ in asyncio.run(run())] == ["ok"] * calls


def test_the_python_tool_runs_code_in_the_sandbox():
    tool = PythonTool(timeout_s=5.0)
    assert tool.call({"code": "print(12*34)"}).text == "408\n"
    secret = Path(__file__).resolve()  # a data file of the repository: out of the sandbox's reach
    read = tool.call({"code": f"print(open({str(secret)!r}).read()[:20])"})
    assert read.error and "Permission denied" in read.text and "import asyncio" not in read.text
    net = tool.call({"code": "import socket; socket.create_connection(('127.0.0.1', 9), 1); print('reached')"})
    assert net.error and "sandbox_violation" in net.text and "reached" not in net.text
    slow = tool.call({"code": "while True: pass"})
    assert slow.error and "timeout" in slow.text
    assert tool.call({"code": 1}).error


def test_python_tool_code_cannot_touch_what_scores_it(tmp_path):
    """Model-written code in the tool can neither write a file outside its own folder (a
    verdict, a checkpoint) nor signal the process that runs the rollout and the verifiers."""
    tool = PythonTool(timeout_s=5.0)
    verdict = tmp_path / "verdict.json"
    verdict.write_text("0")
    write = tool.call({"code": f"open({str(verdict)!r}, 'w').write('1'); print('wrote')"})
    assert write.error and "wrote" not in write.text and verdict.read_text() == "0"
    kill = tool.call({"code": f"import os, signal; os.kill({os.getpid()}, signal.SIGKILL); print('sent')"})
    assert kill.error and "sent" not in kill.text  # and this process is alive to say so
