"""Reasoning is not the answer: what a model writes between <think> and </think> is dropped
before any verifier looks for an answer or a solution in a response."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def strip_reasoning(response: str) -> str:
    """The text after the last </think> (templates such as DeepSeek-R1's open <think> in the
    prompt, so a response may hold only the closing tag). A response that opens <think> and
    never closes it was cut off while reasoning: it has no answer, so "" comes back."""
    if THINK_CLOSE in response:
        return response.rsplit(THINK_CLOSE, 1)[1].strip()
    if THINK_OPEN in response:
        return ""
    return response
