"""The CPU engine's OpenAI-compatible chat endpoint, `POST /v1/chat/completions`, with OpenAI's
field names (messages, temperature, top_p, seed, max_tokens, n, stop; choices[].message.content,
choices[].finish_reason, usage) as SGLang 0.5.23 serves it, so one `openai` client talks to
either (an LLM judge does: megatron_rlvr.rewards.judge). The messages go through the model's
chat template; generation goes through the engine's scheduler like any /generate request.

Structured output: `regex`, as SGLang's endpoint takes it, is honoured for patterns with a
finite set of matches (literals, [classes], \\d, (a|b) alternatives, ?): the matches are
tokenized into a trie, and at every step the logits outside the tokens the trie allows are
masked (end of sequence once a whole match is written), so the reply is always one of the
matches. Any other pattern, `json_schema`, `ebnf`, a non-text `response_format` and `stream`
are refused in one line: never silently ignored."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Literal

import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from megatron_rlvr.rollout.cpu_engine import CpuEngine, EngineError
from megatron_rlvr.rollout.protocol import SamplingParams

MAX_MATCHES = 4096  # strings a regex may expand to


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    response_format: dict | None = None


# ------------------------------------------------------------------ finite regex → its matches
class _Pattern:
    """A recursive-descent reader of the finite subset of regex syntax (see the module doc)."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def refuse(self, what: str) -> EngineError:
        return EngineError(
            f"regex {self.text!r}: {what} at position {self.at}; the CPU engine honours only patterns "
            "with finitely many matches (literals, [classes], \\d, (a|b), ?)"
        )

    def matches(self) -> list[str]:
        out = self._alternatives()
        if self.at != len(self.text):
            raise self.refuse(f"unexpected {self.text[self.at]!r}")
        return out

    def _alternatives(self) -> list[str]:
        out = self._sequence()
        while self.at < len(self.text) and self.text[self.at] == "|":
            self.at += 1
            out = out + self._sequence()
        return list(dict.fromkeys(out))

    def _sequence(self) -> list[str]:
        out = [""]
        while self.at < len(self.text) and self.text[self.at] not in "|)":
            atom = self._atom()
            if self.at < len(self.text) and self.text[self.at] == "?":
                self.at += 1
                atom = ["", *atom]
            out = [a + b for a in out for b in atom]
            if len(out) > MAX_MATCHES:
                raise self.refuse(f"more than {MAX_MATCHES} matches")
        return out

    def _atom(self) -> list[str]:
        c = self.text[self.at]
        self.at += 1
        if c == "(":
            if self.text.startswith("?:", self.at):
                self.at += 2
            inner = self._alternatives()
            if self.at >= len(self.text) or self.text[self.at] != ")":
                raise self.refuse("an unclosed (")
            self.at += 1
            return inner
        if c == "[":
            return self._class()
        if c == "\\":
            return self._escape()
        if c in ".*+{}^$]":
            self.at -= 1
            raise self.refuse(f"{c!r} is not supported")
        return [c]

    def _escape(self) -> list[str]:
        if self.at >= len(self.text):
            raise self.refuse("a trailing backslash")
        c = self.text[self.at]
        self.at += 1
        if c == "d":
            return list("0123456789")
        if c.isalnum():
            raise self.refuse(f"\\{c} is not supported")
        return [c]

    def _class(self) -> list[str]:
        if self.text.startswith("^", self.at):
            raise self.refuse("a negated class")
        chars: list[str] = []
        while self.at < len(self.text) and self.text[self.at] != "]":
            first = self._class_char()
            if self.text.startswith("-", self.at) and not self.text.startswith("-]", self.at):
                self.at += 1
                last = self._class_char()
                chars += [chr(i) for i in range(ord(first), ord(last) + 1)]
            else:
                chars.append(first)
        if self.at >= len(self.text):
            raise self.refuse("an unclosed [")
        self.at += 1
        return list(dict.fromkeys(chars))

    def _class_char(self) -> str:
        """One character inside [...]: itself, or escaped (\\d is not taken there)."""
        c = self.text[self.at]
        self.at += 1
        if c != "\\":
            return c
        escaped = self._escape()
        if len(escaped) != 1:
            raise self.refuse("\\d inside a class is not supported")
        return escaped[0]


def regex_matches(pattern: str) -> list[str]:
    """Every string the pattern matches in full (EngineError for a pattern outside the subset)."""
    return _Pattern(pattern).matches()


class TokenTrie:
    """The matches as token sequences: at each point of a reply, the tokens that keep it on
    the way to a whole match, and end of sequence once one is complete."""

    def __init__(self, token_seqs: list[list[int]], end_ids: set[int]):
        self.children: list[dict[int, int]] = [{}]
        self.complete: list[bool] = [False]
        for seq in token_seqs:
            node = 0
            for token in seq:
                if token not in self.children[node]:
                    self.children.append({})
                    self.complete.append(False)
                    self.children[node][token] = len(self.children) - 1
                node = self.children[node][token]
            self.complete[node] = True
        self.end_ids = sorted(end_ids)

    def allowed(self, node: int) -> list[int]:
        return [*self.children[node], *(self.end_ids if self.complete[node] else [])]


class TokenConstraint:
    """One reply's place in the trie; the engine's sampler masks what allowed() leaves out and
    calls advance() with each token it draws (rollout/sampling.py)."""

    def __init__(self, trie: TokenTrie):
        self.trie, self.node = trie, 0

    def mask(self, vocab: int) -> torch.Tensor:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[self.trie.allowed(self.node)] = True
        return keep

    def advance(self, token: int) -> None:
        self.node = self.trie.children[self.node].get(token, self.node)


def _trie(pattern: str, engine: CpuEngine) -> TokenTrie:
    tokenizer = engine.tokenizer
    if not engine.eos_ids:
        raise EngineError("regex: this model has no end-of-sequence token to end a constrained reply with")
    matches = regex_matches(pattern)
    seqs = [tokenizer.encode(m, add_special_tokens=False) for m in matches]
    if any(not seq or tokenizer.decode(seq) != m for seq, m in zip(seqs, matches)):
        raise EngineError(f"regex {pattern!r}: a match the tokenizer does not write back as it is (or an empty one)")
    return TokenTrie(seqs, engine.eos_ids)


# ------------------------------------------------------------------ the endpoint
def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.stream:
        raise EngineError("stream: streaming is not supported by the CPU engine")
    for name in ("json_schema", "ebnf"):
        if getattr(req, name) is not None:
            raise EngineError(f"{name}: the CPU engine honours only `regex` (finite patterns) as structured output")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise EngineError("response_format: the CPU engine honours only `regex` (finite patterns) as structured output")


def _sampling(req: ChatCompletionRequest, prompt_len: int, engine: CpuEngine, trie: TokenTrie | None):
    longest = engine.context_length - prompt_len
    if longest < 1:
        raise EngineError(
            f"messages: the prompt ({prompt_len} tokens) fills the model's context length ({engine.context_length})"
        )
    max_new = req.max_completion_tokens or req.max_tokens or longest
    params = SamplingParams(
        max_new_tokens=min(max_new, longest),
        temperature=req.temperature,
        top_p=req.top_p,
        n=req.n if trie is None else 1,
        stop=req.stop,
        sampling_seed=req.seed,
    )
    if trie is None:
        return [params]
    # one request per reply, each with its own place in the trie (and its own seed)
    out = []
    for i in range(req.n):
        one = params.model_copy(update={"sampling_seed": None if req.seed is None else req.seed + i})
        one._constraint = TokenConstraint(trie)
        out.append(one)
    return out


def add_chat_endpoint(app: FastAPI, engine: CpuEngine, parse) -> None:
    """Registers /v1/chat/completions and /v1/models on the CPU engine's app (server.create_app;
    its key check covers them). parse: the server's body parser (EngineError on bad input)."""

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_dir, "object": "model", "owned_by": "megatron-rlvr"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatCompletionRequest)
        _refuse_unsupported(req)
        tokenizer = engine.tokenizer
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise EngineError("messages: this model has no tokenizer with a chat template")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        trie = _trie(req.regex, engine) if req.regex is not None else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        seqs = [s for params in _sampling(req, len(prompt), engine, trie) for s in engine.submit(prompt, params, rid)]
        finished = await asyncio.gather(*(asyncio.wrap_future(s.future) for s in seqs))
        choices = []
        for index, seq in enumerate(finished):
            reason = seq.finish.type if seq.finish is not None else "abort"
            text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reason,
                    "logprobs": None,
                }
            )
        completion = sum(len(s.output_ids) for s in finished)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or engine.model_dir,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
            },
        }
