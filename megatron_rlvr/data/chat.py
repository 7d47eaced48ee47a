"""Records → the token ids the engines receive. With a chat template (the tokenizer's, or
data.chat_template) the ids are exactly HF's `apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)` with data.chat_template_kwargs; without one, the
prompt text after <bos>. Prompts longer than data.max_prompt_tokens are dropped and counted."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rlvr.config import PromptFormat
from megatron_rlvr.data.records import DataError, PromptRecord

log = logging.getLogger(__name__)
CHUNK = 1024  # conversations rendered and tokenized per call


@dataclass
class EncodedPrompts:
    """The records that fit, and their prompt ids by prompt id (int32: compact for big sets)."""

    records: list[PromptRecord]
    ids: dict[str, np.ndarray]
    too_long: int = 0

    def encode(self, record: PromptRecord) -> list[int]:
        return self.ids[record.prompt_id].tolist()


class PromptRenderer:
    def __init__(self, tokenizer, fmt: PromptFormat):
        self.tokenizer, self.fmt = tokenizer, fmt
        self.template = _template_text(fmt.chat_template)
        has_template = self.template is not None or getattr(tokenizer, "chat_template", None) is not None
        if fmt.apply_chat_template and not has_template:
            raise DataError(
                "data.apply_chat_template = true: the tokenizer has no chat template (give one in data.chat_template)"
            )
        self.chat = has_template if fmt.apply_chat_template is None else fmt.apply_chat_template

    def messages(self, record: PromptRecord) -> list[dict]:
        """The conversation to render: the record's messages (a string prompt is one user
        message), the system prompt first unless the record has its own, the instruction
        appended to the last user message."""
        messages = (
            [{"role": "user", "content": record.prompt}]
            if isinstance(record.prompt, str)
            else [dict(m) for m in record.prompt]
        )
        if self.fmt.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.fmt.system_prompt})
        if self.fmt.instruction:
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last]["content"] = f"{messages[last]['content']} {self.fmt.instruction}"
        return messages

    def render(self, messages: list[dict], *, generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        """One conversation's ids through the chat template, with `tools` (OpenAI function
        schemas) given to it as HF's apply_chat_template gives them: the template decides how
        they, assistant tool_calls and tool turns render."""
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
                chat_template=self.template,
                **self.fmt.chat_template_kwargs,
            )
        )

    def _ids(self, conversations: list[list[dict]]) -> list[list[int]]:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                conversations,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                chat_template=self.template,
                **self.fmt.chat_template_kwargs,
            )
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        texts = ["\n".join(m["content"] for m in conversation) for conversation in conversations]
        return [bos + ids for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, records: list[PromptRecord], *, what: str = "data") -> EncodedPrompts:
        """Every record's prompt ids; those over max_prompt_tokens dropped (logged once, with
        the count). Records repeated by mixing weights are encoded once."""
        unique = list({r.prompt_id: r for r in records}.values())
        ids: dict[str, np.ndarray] = {}
        limit = self.fmt.max_prompt_tokens
        too_long: set[str] = set()
        for start in range(0, len(unique), CHUNK):
            chunk = unique[start : start + CHUNK]
            for record, prompt_ids in zip(chunk, self._ids([self.messages(r) for r in chunk])):
                if limit is not None and len(prompt_ids) > limit:
                    too_long.add(record.prompt_id)
                else:
                    ids[record.prompt_id] = np.asarray(prompt_ids, dtype=np.int32)
        kept = [r for r in records if r.prompt_id in ids]
        if too_long:
            log.warning(
                "%s: %d of %d prompts are longer than data.max_prompt_tokens = %d tokens: dropped",
                what,
                len(too_long),
                len(unique),
                limit,
            )
        if not kept:
            raise DataError(f"{what}: every prompt is longer than data.max_prompt_tokens = {limit}")
        return EncodedPrompts(kept, ids, len(too_long))


def _template_text(template: str | None) -> str | None:
    """data.chat_template: a path to a .jinja file, or the template itself."""
    if template is None or not template.strip().endswith(".jinja"):
        return template
    try:
        return Path(template).read_text()
    except OSError as err:
        raise DataError(f"data.chat_template = {template!r}: cannot read it ({err.strerror})") from None
