"""Tool calls parsed from a model turn's text, in the model family's own format.

- `hermes` (Qwen2/Qwen3 and Hermes templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one JSON object per block, as many blocks as the turn has (SGLang: `qwen`, `qwen25`, `hermes`).
- `glm45` (GLM-4.5/4.6): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`;
  a value is JSON where it parses as JSON and the schema does not say string (SGLang: `glm45`).
- `deepseekv3` (DeepSeek-V3): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`,
  the arguments in a ```json block, `<｜tool▁call▁end｜>`… `<｜tool▁calls▁end｜>` (SGLang: `deepseekv3`).

A call that cannot be read (bad JSON, no name, arguments that are not an object, a block left
open) is never an exception: it comes back as a ParsedCall with `error` set, and the episode
shows that error to the model as the call's result. SGLang's own parsers drop such calls
silently; tests/test_agent_parsers.py checks that ours and SGLang's agree on every call both read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.errors import UserError


class ToolFormatError(UserError):
    """agent.tool_call_format names no parser, or the family has none by default."""


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call could not be read (shown to the model)


@dataclass
class ParsedTurn:
    content: str  # the text before the first call (the model's prose)
    calls: list[ParsedCall]


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


def _blocks(text: str) -> tuple[str, list[str], bool]:
    """(text before the first block, each block's inside, whether a block was left open)."""
    start = text.find(_OPEN)
    if start < 0:
        return text, [], False
    inside = _BLOCK.findall(text)
    unclosed = text.rfind(_OPEN) > text.rfind(_CLOSE)
    return text[:start].strip(), inside, unclosed


def parse_hermes(text: str, schemas: dict[str, dict] | None = None) -> ParsedTurn:
    content, blocks, unclosed = _blocks(text)
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block.strip())
        except (ValueError, RecursionError) as err:
            calls.append(ParsedCall("", error=f"the tool call is not valid JSON ({err})"))
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            calls.append(_from_json(item))
    if unclosed:
        calls.append(ParsedCall("", error=f"a {_OPEN} was not closed with {_CLOSE}"))
    return ParsedTurn(content, calls)


def _from_json(item: Any) -> ParsedCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return ParsedCall("", error='a tool call must be {"name": "...", "arguments": {...}}')
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ParsedCall(item["name"], error="the tool call's arguments must be a JSON object")
    return ParsedCall(item["name"], arguments)


_GLM_DETAIL = re.compile(r"(.*?)(?:\\n|\n)(.*)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _property_type(schemas: dict[str, dict] | None, name: str, key: str) -> str | None:
    function = ((schemas or {}).get(name) or {}).get("function", {})
    prop = (function.get("parameters") or {}).get("properties", {}).get(key) or {}
    kind = prop.get("type")
    return kind if isinstance(kind, str) else None


def parse_glm45(text: str, schemas: dict[str, dict] | None = None) -> ParsedTurn:
    content, blocks, unclosed = _blocks(text)
    calls = []
    for block in blocks:
        detail = _GLM_DETAIL.fullmatch(block)
        name, body = (detail.group(1), detail.group(2)) if detail else (block, "")
        name = name.strip()
        if not name:
            calls.append(ParsedCall("", error="a tool call must start with the tool's name"))
            continue
        arguments: dict[str, Any] = {}
        for key, raw in _GLM_ARG.findall(body):
            key = key.strip()
            if _property_type(schemas, name, key) == "string":
                arguments[key] = raw
                continue
            try:
                arguments[key] = json.loads(raw)
            except (ValueError, RecursionError):
                arguments[key] = raw
        calls.append(ParsedCall(name, arguments))
    if unclosed:
        calls.append(ParsedCall("", error=f"a {_OPEN} was not closed with {_CLOSE}"))
    return ParsedTurn(content, calls)


_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_DETAIL = re.compile(r"(.*)<｜tool▁sep｜>(.*?)\n```json\n(.*)\n```", re.DOTALL)


def parse_deepseekv3(text: str, schemas: dict[str, dict] | None = None) -> ParsedTurn:
    start = text.find(_DS_BEGIN)
    if start < 0:
        return ParsedTurn(text, [])
    calls = []
    for block in _DS_CALL.findall(text[start:]):
        detail = _DS_DETAIL.fullmatch(block)
        if detail is None:
            calls.append(ParsedCall("", error="a tool call must be function<｜tool▁sep｜>NAME then a ```json block"))
            continue
        name, raw = detail.group(2).strip(), detail.group(3)
        try:
            arguments = json.loads(raw)
        except (ValueError, RecursionError) as err:
            calls.append(ParsedCall(name, error=f"the tool call's arguments are not valid JSON ({err})"))
            continue
        calls.append(_from_json({"name": name, "arguments": arguments}))
    if _DS_END not in text[start:]:
        calls.append(ParsedCall("", error=f"a {_DS_BEGIN} was not closed with {_DS_END}"))
    return ParsedTurn(text[:start].strip(), calls)


Parser = Callable[[str, "dict[str, dict] | None"], ParsedTurn]
PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "glm45": parse_glm45, "deepseekv3": parse_deepseekv3}
# the format each shipped family's chat template writes tool calls in (families.py)
FAMILY_FORMATS = {"qwen3_moe": "hermes", "qwen2_moe": "hermes", "glm4_moe": "glm45", "deepseek_v3": "deepseekv3"}


def parser_for(fmt: str | None, model_type: str | None) -> Parser:
    """The parser agent.tool_call_format names, or the family's own (None: the default)."""
    name = fmt or FAMILY_FORMATS.get(model_type or "")
    if name is None:
        raise ToolFormatError(
            f"agent.tool_call_format: the {model_type} family has no default tool-call format; "
            f"set one of {', '.join(PARSERS)}"
        )
    if name not in PARSERS:
        raise ToolFormatError(f"agent.tool_call_format = {name!r}: not one of {', '.join(PARSERS)}")
    return PARSERS[name]
