"""The judge's prompt templates and the score format: a reply is `Score: N`, N an integer in
[min_score, max_score]; the regex that constrains the judge to it, and the reading of a reply
(anything else scores 0 with the reason)."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_rlvr.config.judge import JudgeConfig

REFERENCE = """You are grading a response to a question against a reference answer.
Question:
{prompt}
Reference answer:
{reference}
Response:
{response}
Rate how well the response answers the question, as judged against the reference, from {min_score} (wrong) to {max_score} (fully correct). Reply with exactly `Score: N`."""

OPEN_ENDED = """You are grading a response to a request.
Request:
{prompt}
Response:
{response}
Rate the response's helpfulness, correctness and clarity from {min_score} (useless) to {max_score} (excellent). Reply with exactly `Score: N`."""

BUILTIN = {"reference": REFERENCE, "open_ended": OPEN_ENDED}
_SCORE = re.compile(r"Score:\s*(-?\d+)")


def template_text(cfg: JudgeConfig) -> str:
    """The template verifier.judge.template names (a built-in one or the user's file)."""
    return BUILTIN.get(cfg.template) or Path(cfg.template).read_text()


def needs_reference(text: str) -> bool:
    return "{reference}" in text


def render(text: str, cfg: JudgeConfig, *, prompt: str, response: str, reference: str | None) -> str:
    """The template with its placeholders filled (one pass, so braces inside the prompt or the
    response are never read as placeholders)."""
    values = {
        "prompt": prompt,
        "response": response,
        "reference": reference or "",
        "min_score": str(cfg.min_score),
        "max_score": str(cfg.max_score),
    }
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


def score_regex(cfg: JudgeConfig) -> str:
    """The whole reply the judge is constrained to: `Score: ` and one of the allowed numbers."""
    return "Score: (" + "|".join(str(n) for n in range(cfg.min_score, cfg.max_score + 1)) + ")"


def read_score(reply: str, cfg: JudgeConfig) -> tuple[float, str]:
    """(reward, reason): the last `Score: N` in the reply, normalised to [0, 1]; 0 with
    judge_unparsed when there is none, judge_out_of_range when N is outside the range."""
    found = _SCORE.findall(reply)
    if not found:
        return 0.0, "judge_unparsed"
    n = int(found[-1])
    if not cfg.min_score <= n <= cfg.max_score:
        return 0.0, "judge_out_of_range"
    return (n - cfg.min_score) / (cfg.max_score - cfg.min_score), "judge_scored"
