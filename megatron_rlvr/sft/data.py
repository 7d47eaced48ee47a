"""Supervised fine-tuning data: conversations (built-in worked solutions, or files in verl's
SFT layouts) rendered by the run's chat-template path into token ids with a mask over the
assistant's tokens, and the token-budget batches a step trains on.

A conversation's tokens are the chat template applied to the whole conversation; assistant
turn i covers the tokens between the template applied to the messages before it (with the
generation prompt, exactly what an RL prompt renders to) and the template applied up to and
including it. Only those tokens enter the loss."""

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
from megatron_rlvr.data.files import lookup
from megatron_rlvr.data.long_answers import worked_examples
from megatron_rlvr.data.records import ROLES, DataError, PromptRecord
from megatron_rlvr.learner.batch import TrainBatch, budget_bins

Conversation = list[dict[str, Any]]


@dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 where the token is the assistant's (a target of the loss)

    def __len__(self) -> int:
        return len(self.ids)


# ----------------------------------------------------------------------------- loading
def load_conversations(sft: SftConfig, seed: int) -> list[Conversation]:
    """Every conversation of sft.data, each with at least one assistant turn."""
    source = sft.data
    if isinstance(source, SftLongAnswers):
        return worked_examples(source, source.step_error_rate, seed)
    conversations = []
    for path in source.paths:
        for where, row in _rows(Path(path)):
            conversations.append(_conversation(row, source, where))
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


def _conversation(row: dict, source: SftFile, where: str) -> Conversation:
    if source.format == "messages":
        messages = lookup(row, source.messages_key)
    else:
        prompt, response = lookup(row, source.prompt_key), lookup(row, source.response_key)
        if not isinstance(response, str):
            raise DataError(f"{where}: {source.response_key!r} must be a string (the assistant's response)")
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [*turns, {"role": "assistant", "content": response}] if isinstance(turns, list) else None
    key = source.messages_key if source.format == "messages" else source.prompt_key
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages
    ):
        raise DataError(f"{where}: {key!r} must be a list of {{role, content}} messages (roles: {', '.join(ROLES)})")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# ----------------------------------------------------------------------------- rendering
class ConversationRenderer:
    """Token ids and assistant mask of a conversation, through PromptRenderer's settings
    (chat template, system prompt, instruction) so SFT sees what RL prompts look like."""

    def __init__(self, tokenizer, fmt: PromptFormat):
        self.prompts = PromptRenderer(tokenizer, fmt)
        self.tokenizer = tokenizer

    def _render(self, messages: Conversation, generation_prompt: bool) -> list[int]:
        p = self.prompts
        if p.chat:
            return list(
                self.tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=generation_prompt,
                    tokenize=True,
                    return_dict=False,
                    chat_template=p.template,
                    **p.fmt.chat_template_kwargs,
                )
            )
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        ids = self.tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=False)["input_ids"]
        eos = [self.tokenizer.eos_token_id] if messages[-1]["role"] == "assistant" else []
        return bos + list(ids) + eos

    def example(self, conversation: Conversation) -> Example:
        """The conversation's ids and mask (system prompt and instruction applied to its
        prompt part as PromptRenderer applies them to an RL prompt)."""
        first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        prompt = self.prompts.messages(PromptRecord("sft", conversation[:first]))
        messages = [*prompt, *conversation[first:]]
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], generation_prompt=True)
            through = self._render(messages[: i + 1], generation_prompt=False)
            if through[: len(before)] != before or ids != before[: len(ids)]:
                raise DataError(
                    "sft: the chat template does not render a conversation as a prefix of its continuation; "
                    "assistant turns cannot be masked"
                )
            mask += [0] * (len(before) - len(ids)) + [1] * (len(through) - len(before))
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
