"""Tool calls read from model text (agent/parsers.py), malformed calls as errors the model sees,
and agreement with SGLang's own parsers (real SGLang, .venv-sglang) on the calls both read."""

import json
import subprocess

import pytest
from engine_fixtures import sglang_python

from megatron_rlvr.agent.parsers import ToolFormatError, parse_deepseekv3, parse_glm45, parse_hermes, parser_for

SCHEMAS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
    "search": {
        "type": "function",
        "function": {
            "name": "search",
            "description": "",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
            },
        },
    },
}

HERMES = [
    'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "moe", "k": 3}}</tool_call>\n'
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {"query": "ünïcode \\"quoted\\"", "k": 1}}\n</tool_call>',
    "The answer is 408.",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+"\n</tool_call>',  # bad JSON
    '<tool_call>{"arguments": {"expression": "2"}}</tool_call>',  # no name
    '<tool_call>{"name": "calculator", "arguments": ["2+2"]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "calculator", "arguments": {"expression": "3*3"}}</tool_call><tool_call>{"name": ',
]
GLM = [
    "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>12*34</arg_value>\n</tool_call>",
    "ok <tool_call>search\n<arg_key>query</arg_key>\n<arg_value>42</arg_value>\n"
    "<arg_key>k</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
    "no call here",
]

B, E, CB, CE, SEP = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
DEEPSEEK = [
    f'Sure.{B}{CB}function{SEP}calculator\n```json\n{{"expression": "12*34"}}\n```{CE}{E}',
    f'{B}{CB}function{SEP}search\n```json\n{{"query": "moe", "k": 2}}\n```{CE}\n'
    f'{CB}function{SEP}calculator\n```json\n{{"expression": "1+1"}}\n```{CE}{E}',
    "no call",
    f'{B}{CB}function{SEP}calculator\n```json\n{{"expression": \n```{CE}{E}',  # bad JSON
]


def _calls(turn):
    return [(c.name, c.arguments) for c in turn.calls if c.error is None]


def test_hermes_reads_calls_and_turns_malformed_ones_into_errors():
    first = parse_hermes(HERMES[0])
    assert first.content == "Let me compute." and _calls(first) == [("calculator", {"expression": "12*34"})]
    assert _calls(parse_hermes(HERMES[1])) == [
        ("search", {"query": "moe", "k": 3}),
        ("calculator", {"expression": "1+1"}),
    ]
    assert parse_hermes(HERMES[3]).calls == []
    bad_json, no_name, not_object = (parse_hermes(t).calls for t in HERMES[4:7])
    assert len(bad_json) == 1 and "not valid JSON" in bad_json[0].error
    assert len(no_name) == 1 and "must be" in no_name[0].error
    assert not_object[0].name == "calculator" and "must be a JSON object" in not_object[0].error
    unclosed = parse_hermes(HERMES[7])
    assert _calls(unclosed) == [("calculator", {"expression": "3*3"})] and "not closed" in unclosed.calls[-1].error
    # arguments written as a JSON string are read
    assert _calls(parse_hermes('<tool_call>{"name": "c", "arguments": "{\\"x\\": 1}"}</tool_call>')) == [
        ("c", {"x": 1})
    ]


def test_glm45_reads_key_value_calls_typed_by_the_schema():
    assert _calls(parse_glm45(GLM[0], SCHEMAS)) == [("calculator", {"expression": "12*34"})]
    turn = parse_glm45(GLM[1], SCHEMAS)
    assert turn.content == "ok" and _calls(turn) == [("search", {"query": "42", "k": 5})]  # query is a string
    assert parse_glm45(GLM[2], SCHEMAS).calls == []


def test_deepseekv3_reads_calls_between_its_special_tokens():
    first = parse_deepseekv3(DEEPSEEK[0])
    assert first.content == "Sure." and _calls(first) == [("calculator", {"expression": "12*34"})]
    assert _calls(parse_deepseekv3(DEEPSEEK[1])) == [
        ("search", {"query": "moe", "k": 2}),
        ("calculator", {"expression": "1+1"}),
    ]
    assert parse_deepseekv3(DEEPSEEK[2]).calls == []
    [bad] = parse_deepseekv3(DEEPSEEK[3]).calls
    assert bad.name == "calculator" and "not valid JSON" in bad.error


def test_the_format_follows_the_family_or_is_refused():
    assert parser_for(None, "qwen3_moe") is parse_hermes and parser_for(None, "glm4_moe") is parse_glm45
    assert parser_for("glm45", "qwen3_moe") is parse_glm45
    assert parser_for(None, "deepseek_v3") is parse_deepseekv3
    with pytest.raises(ToolFormatError, match="the mixtral family has no default tool-call format"):
        parser_for(None, "mixtral")


SGLANG_PARSE = """
import json, sys
from sglang.srt.entrypoints.openai.protocol import Function, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser
cases = json.loads(sys.stdin.read())
tools = [Tool(type="function", function=Function(**s["function"])) for s in cases["schemas"]]
out = []
for name, texts in cases["texts"].items():
    for text in texts:
        normal, calls = FunctionCallParser(tools, name).parse_non_stream(text)
        out.append([[c.name, json.loads(c.parameters)] for c in calls])
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_our_parsers_agree_with_sglangs_on_every_call_both_read():
    cases = {"schemas": list(SCHEMAS.values()), "texts": {"hermes": HERMES, "glm45": GLM, "deepseekv3": DEEPSEEK}}
    done = subprocess.run(
        [sglang_python(), "-c", SGLANG_PARSE], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = (
        [parse_hermes(t, SCHEMAS) for t in HERMES]
        + [parse_glm45(t, SCHEMAS) for t in GLM]
        + [parse_deepseekv3(t, SCHEMAS) for t in DEEPSEEK]
    )
    assert len(theirs) == len(ours)
    same = 0
    for text, mine, sglang in zip(HERMES + GLM + DEEPSEEK, ours, theirs):
        read, errors = _calls(mine), [c for c in mine.calls if c.error is not None]
        sglang = [(name, arguments) for name, arguments in sglang]
        # a call both read is read the same; the two differ only on turns that hold a malformed
        # call (SGLang then drops the turn's calls, or passes non-object arguments on; we run the
        # good ones and show the model an error for the bad)
        assert [c for c in sglang if c in read] == [c for c in read if c in sglang], text
        if sglang != read:
            assert errors, text
        same += sglang == read
    assert same == len(ours) - 2 and sum(map(len, theirs)) >= 6
