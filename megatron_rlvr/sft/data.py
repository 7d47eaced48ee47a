"""Supervised fine-tuning data: conversations (built-in worked solutions, or files in verl's
SFT layouts, tool conversations included) rendered by the run's chat-template path into token
ids with a mask over the tokens the assistant generates, and the token-budget batches a step
trains on.

A conversation's tokens are the chat template applied to the whole conversation (with its
tools, OpenAI function schemas, given to the template as HF's apply_chat_template gives them),
up to its last assistant turn. Assistant turn i covers the tokens between the template applied
to the messages before it (with the generation prompt, exactly what an RL prompt or an
episode's next turn renders to) and the template applied up to and including it; of those,
the loss takes what the model generates: its content, its tool calls and its end token (the
tokenizer's eos), not the boundary the template writes after the end token (Qwen's newline).
System, user and tool turns, tool schemas and generation prompts are 0. Each prefix render must
begin with the render before it: a template that re-renders history once later turns follow
(one that strips past reasoning, say) is refused in one line naming the record, since its
assistant turns have no tokens of their own, and an RL episode on it would not be the same
token sequence either. The ids are then exactly the single render of the whole conversation."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.config import PromptFormat
from megatron_rlvr.config.sft import SftConfig, SftFile, SftLongAnswers
from megatron_rlvr.data.chat import PromptRenderer
from megatron_rlvr.data.files import _MISSING, lookup
from megatron_rlvr.data.long_answers import worked_examples
from megatron_rlvr.data.records import ROLES, DataError, PromptRecord
from megatron_rlvr.learner.batch import TrainBatch, budget_bins


@dataclass
class Conversation:
    """One record's messages ({role, content}; an assistant's may carry OpenAI `tool_calls`, a
    tool turn its `tool_call_id` and `name`), the tools (OpenAI function schemas) its template
    is given, and where it came from (errors name it)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    where: str = "sft"


@dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 where the token is one the assistant generates (a target of the loss)

    def __len__(self) -> int:
        return len(self.ids)


# ----------------------------------------------------------------------------- loading
def load_conversations(sft: SftConfig, seed: int) -> list[Conversation]:
    """Every conversation of sft.data, each with at least one assistant turn."""
    source = sft.data
    if isinstance(source, SftLongAnswers):
        worked = worked_examples(source, source.step_error_rate, seed)
        return [Conversation(messages, None, f"long_answers example {i}") for i, messages in enumerate(worked)]
    shared = _tools(source.tools, "sft.data.tools")
    conversations = []
    for path in source.paths:
        for where, row in _rows(Path(path)):
            conversations.append(_conversation(row, source, where, shared))
    if not conversations:
        raise DataError(f"sft.data.path = {source.path!r}: no rows")
    return conversations


def _rows(path: Path):
    if not path.is_file():
        raise DataError(f"sft.data.path = '{path}': no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:row {number}", row
        return
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not valid JSON ({err.msg})") from None


def _conversation(row: dict, source: SftFile, where: str, shared: list[dict] | None) -> Conversation:
    if source.format == "messages":
        messages = lookup(row, source.messages_key)
    else:
        prompt, response = lookup(row, source.prompt_key), lookup(row, source.response_key)
        if not isinstance(response, str):
            raise DataError(f"{where}: {source.response_key!r} must be a string (the assistant's response)")
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [*turns, {"role": "assistant", "content": response}] if isinstance(turns, list) else None
    key = source.messages_key if source.format == "messages" else source.prompt_key
    if not isinstance(messages, list):
        raise DataError(f"{where}: {key!r} must be a list of {{role, content}} messages (roles: {', '.join(ROLES)})")
    checked = [_message(m, f"{where}: {key!r}") for m in messages]
    if not any(m["role"] == "assistant" for m in checked):
        raise DataError(f"{where}: no assistant message to train on")
    own = lookup(row, source.tools_key)
    tools = _tools(own, f"{where}: {source.tools_key!r}") if own is not _MISSING and own is not None else shared
    return Conversation(checked, tools, where)


def _message(m: Any, where: str) -> dict[str, Any]:
    """A message in OpenAI's layout, checked and reduced to what templates read: role and
    content (an assistant's content may be empty or null beside its tool calls), an assistant's
    tool_calls (arguments as a JSON object) and reasoning_content, a tool turn's tool_call_id
    and name."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise DataError(f"{where} must be a list of {{role, content}} messages (roles: {', '.join(ROLES)})")
    calls = m.get("tool_calls") if m["role"] == "assistant" else None
    content = "" if calls and m.get("content") is None else m.get("content")
    if not isinstance(content, str):
        raise DataError(f"{where}: a {m['role']} message's content must be a string")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if calls:
        if not isinstance(calls, list):
            raise DataError(f"{where}: an assistant message's tool_calls must be a list")
        out["tool_calls"] = [_tool_call(call, where) for call in calls]
    kept = {"assistant": ("reasoning_content",), "tool": ("tool_call_id", "name")}.get(m["role"], ())
    out.update({k: m[k] for k in kept if isinstance(m.get(k), str)})
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where}: a tool call must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: tool call {function['name']!r}: its arguments must be a JSON object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """OpenAI function schemas (a list, or its JSON text as Parquet files often hold it)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in value
    ):
        raise DataError(
            f"{where}: tools must be a list of OpenAI function schemas "
            "({'type': 'function', 'function': {'name', 'description', 'parameters'}})"
        )
    return value


# ----------------------------------------------------------------------------- rendering
class ConversationRenderer:
    """Token ids and assistant mask of a conversation, through PromptRenderer's settings
    (chat template, system prompt, instruction) so SFT sees what RL prompts look like."""

    def __init__(self, tokenizer, fmt: PromptFormat):
        self.prompts = PromptRenderer(tokenizer, fmt)
        self.tokenizer = tokenizer
        self.end_ids = {tokenizer.eos_token_id} - {None}

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None) -> list[int]:
        if self.prompts.chat:
            return self.prompts.render(messages, generation_prompt=generation_prompt, tools=tools)
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        ids = self.tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=False)["input_ids"]
        eos = [self.tokenizer.eos_token_id] if messages[-1]["role"] == "assistant" else []
        return bos + list(ids) + eos

    def _generated(self, turn: list[int]) -> list[int]:
        """1 on an assistant turn's tokens up to its end token, 0 on the template's boundary after it."""
        ends = [k for k, token in enumerate(turn) if token in self.end_ids]
        cut = ends[-1] + 1 if ends else len(turn)
        return [1] * cut + [0] * (len(turn) - cut)

    def example(self, conversation: Conversation | list[dict[str, Any]]) -> Example:
        """The conversation's ids and mask, up to its last assistant turn (system prompt and
        instruction applied to its prompt part as PromptRenderer applies them to an RL prompt)."""
        if not isinstance(conversation, Conversation):
            conversation = Conversation(conversation)
        given, tools, where = conversation.messages, conversation.tools, conversation.where
        if not self.prompts.chat and (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in given)):
            raise DataError(f"{where}: tool calls and tool turns need a chat template (data.chat_template)")
        first = next(i for i, m in enumerate(given) if m["role"] == "assistant")
        prompt = self.prompts.messages(PromptRecord("sft", given[:first]))
        messages = [*prompt, *given[first:]]
        messages = messages[: max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1]
        ids: list[int] = []
        mask: list[int] = []
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for turn, i in enumerate(turns, start=1):
            before = self._render(messages[:i], True, tools)
            through = self._render(messages[: i + 1], False, tools)
            if before[: len(ids)] != ids:
                raise DataError(
                    f"{where}: the chat template renders the conversation before assistant turn {turn} differently "
                    "once later turns follow (it re-renders history: past reasoning stripped?), so its assistant "
                    "turns cannot be masked"
                )
            if through[: len(before)] != before:
                raise DataError(
                    f"{where}: the chat template's render of assistant turn {turn} does not begin with its "
                    "generation prompt, so its tokens cannot be masked"
                )
            mask += [0] * (len(before) - len(ids)) + self._generated(through[len(before) :])
            ids = through
        return Example(ids, mask)


# ----------------------------------------------------------------------------- batching
def step_batches(examples: list[Example], batch_tokens: int, steps: int, seed: int) -> list[list[Example]]:
    """The examples of every step: shuffled epochs, each step taking examples until it holds
    batch_tokens tokens (at least one). A pure function of the seed, so a resumed run takes
    the same batches from its step on."""
    rng = random.Random(seed)
    order: list[int] = []
    batches = []
    for _ in range(steps):
        batch: list[Example] = []
        tokens = 0
        while True:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            example = examples[order[-1]]
            if batch and tokens + len(example) > batch_tokens:
                break
            order.pop()
            batch.append(example)
            tokens += len(example)
        batches.append(batch)
    return batches


def pack_micro_batches(
    examples: list[Example], micro_batch_tokens: int, pad_id: int, packed: bool = False, row_tokens: int | None = None
) -> list[TrainBatch]:
    """Rows grouped longest first: a micro-batch takes the next row while its padded size
    (rows × its longest row) stays within micro_batch_tokens. Neighbours in length share a
    micro-batch, so little of it is padding (back-filling a long row's micro-batch with short
    ones, as first-fit would, pads each of them to the long one). Packed (sft.pack_sequences):
    examples back to back in rows of at most row_tokens (first-fit decreasing on their summed
    lengths; default micro_batch_tokens), each attending only to itself, and
    micro_batch_tokens // row_tokens rows a micro-batch, padded only at their ends to the
    longest: attention costs row_tokens², not micro_batch_tokens²."""
    if packed:
        row_tokens = row_tokens or micro_batch_tokens
        rows = budget_bins([len(e) for e in examples], row_tokens, packed=True)
        per_micro = max(1, micro_batch_tokens // row_tokens)
        return [
            _packed_rows([[examples[i] for i in row] for row in rows[first : first + per_micro]], pad_id)
            for first in range(0, len(rows), per_micro)
        ]
    bins: list[list[Example]] = []
    for example in sorted(examples, key=len, reverse=True):
        if bins and (len(bins[-1]) + 1) * len(bins[-1][0]) <= micro_batch_tokens:
            bins[-1].append(example)
        else:
            bins.append([example])
    return [_to_batch(members, pad_id) for members in bins]


def _packed_rows(rows: list[list[Example]], pad_id: int) -> TrainBatch:
    """Each row's examples back to back, with the number of the example each position holds;
    rows right-padded to the longest, padding numbered -1 and never a target (it comes after
    every real position of its row, which causal attention never lets see it). An example's
    first position is no target, as in a padded row's position 0: its logprob would come from
    the example before."""
    width = max(sum(len(e) for e in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for number, example in enumerate(row):
            end = start + len(example)
            ids[r, start:end] = torch.tensor(example.ids)
            mask[r, start + 1 : end] = torch.tensor(example.mask[1:], dtype=torch.float32)
            segments[r, start:end] = number
            start = end
    return TrainBatch(ids, mask, segments=segments)


def _to_batch(members: list[Example], pad_id: int) -> TrainBatch:
    width = max(len(e) for e in members)
    ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(members), width)
    for row, example in enumerate(members):
        ids[row, : len(example)] = torch.tensor(example.ids)
        mask[row, : len(example)] = torch.tensor(example.mask, dtype=torch.float32)
    return TrainBatch(ids, mask)
