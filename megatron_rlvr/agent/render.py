"""Token in, token out: the ids an episode sends the engine are the prompt's, then each model
turn's tokens exactly as the engine sampled them, then each tool turn's tokens as the chat
template renders it. Nothing is ever re-tokenized from decoded text.

A tool turn's tokens are the suffix the template adds after the model's turn: render the
conversation through the model's turn (A = [history..., assistant]) and with the tool results
appended (B = [history..., assistant, tool...] and the generation prompt); the tool turn is
B[len(A):]. The template closes an assistant turn with its end token and often a separator
after it (Qwen's `<|im_end|>` then `\\n`); the model stops at the end token, so the separator
(and the end token itself, when the model stopped on a stop string instead) is taken from A:
its tokens after the last end token. Those boundary tokens, like the tool turn, are never the
model's: loss mask 0.

The exact-prefix property, checked every turn: A must be a prefix of B, i.e. appending a tool
turn must not change how the template renders the turns before it. A template that strips or
rewrites past `<think>` blocks breaks it. Such a template is refused when the run starts
(check_template, one line), and a break seen during a run (some content the check did not
probe) ends that episode at the turn where it happened, counted in agent/prefix_breaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rlvr.errors import UserError


class TemplateBreaksPrefix(UserError):
    """The chat template renders earlier turns differently once a tool turn follows."""


@dataclass
class Bridge:
    """What goes between a model turn and the next: `ids` (boundary tokens, then the tool turn
    and the generation prompt), of which the first `boundary` are the template's turn end; or
    `broken` (why the exact-prefix property failed)."""

    ids: list[int]
    boundary: int = 0
    broken: str | None = None


class TurnRenderer:
    def __init__(
        self,
        tokenizer,
        *,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.kwargs = dict(template_kwargs or {})
        self.tools = tools or None
        eos = tokenizer.eos_token_id
        self.end_ids = set(eos if isinstance(eos, list) else [eos]) - {None}

    def render(self, messages: list[dict], *, generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
            chat_template=self.chat_template,
            **self.kwargs,
        )
        return list(ids)

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first turn's input: the conversation with the tool schemas and the generation prompt."""
        return self.render(messages, generation_prompt=True)

    def bridge(
        self, history: list[dict], assistant_text: str, tool_messages: list[dict], model_ids: list[int]
    ) -> Bridge:
        """The ids to append after a model turn (`model_ids`, whose text is assistant_text)
        so that the next turn's input ends with the template's tool turn and generation prompt."""
        assistant = {"role": "assistant", "content": assistant_text}
        through = self.render([*history, assistant], generation_prompt=False)
        extended = self.render([*history, assistant, *tool_messages], generation_prompt=True)
        if extended[: len(through)] != through:
            at = next(i for i, (a, b) in enumerate(zip(through, extended)) if a != b) if extended else 0
            return Bridge(
                [],
                broken=f"appending a tool turn changed the rendering of the turns before it at token {at} "
                "(the template rewrites past turns, e.g. strips <think>)",
            )
        ends = [i for i, token in enumerate(through) if token in self.end_ids]
        if not ends:
            return Bridge([], broken="the template closes an assistant turn with no end-of-turn token")
        stopped_on_end = bool(model_ids) and model_ids[-1] in self.end_ids
        boundary = through[ends[-1] + 1 :] if stopped_on_end else through[ends[-1] :]
        return Bridge(boundary + extended[len(through) :], boundary=len(boundary))


def check_template(renderer: TurnRenderer) -> None:
    """Refuses, in one line, a template that rewrites past turns once a tool turn follows
    (probed with a turn that reasons in <think> and calls a tool)."""
    history = [{"role": "user", "content": "What is 2+3?"}]
    text = '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    bridge = renderer.bridge(history, text, [{"role": "tool", "content": "5"}], [])
    if bridge.broken:
        raise TemplateBreaksPrefix(
            f"agent: the chat template cannot run episodes token in, token out: {bridge.broken}; "
            "give data.chat_template one that keeps past assistant turns as they were"
        )
