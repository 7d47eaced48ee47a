"""The `ifeval` verifier on the parent side: each response is scored by checkers.score in the
sandbox (runner.py), as users' functions are, one confined child per response with the
verifier's time and memory limits; a checker that raises, runs out of time or memory is a 0
with that reason (runtime_error, timeout, memory), counted in the run's metrics."""

from __future__ import annotations

from typing import Any

from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.rewards.reasoning import strip_reasoning
from megatron_rlvr.rewards.verdict import Verdict

SCORE = {"module": "megatron_rlvr.rewards.instruction.checkers", "function": "score", "search": []}


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """What the checkers that compare with the prompt see: the last user message."""
    if isinstance(prompt, str):
        return prompt
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


def _verdict(answer: dict) -> Verdict:
    outcome = answer.get("outcome") or answer["error"]
    status = outcome.get("status") or outcome.get("reason", "sandbox_error")
    if status != "scored":
        return 0.0, status
    value = outcome["value"]
    return value, "all_followed" if value == 1.0 else "partly_followed" if value > 0.0 else "not_followed"


class IFEvalVerifier:
    """grading: binary or fraction (checkers.score); loose: IFEval's loose reading."""

    def __init__(self, *, grading: str, loose: bool, timeout_s: float, memory_mb: int, parallel: int = 1):
        self.settings = {"grading": grading, "loose": loose}
        self.timeout_s, self.memory_mb, self.parallel = timeout_s, memory_mb, parallel

    def verify_batch(self, responses: list[str], record: PromptRecord) -> list[Verdict]:
        from megatron_rlvr.rewards.runner import run_jobs

        task = {"ground_truth": record.answer, "prompt": prompt_text(record.prompt), **self.settings}
        verdicts: list[Verdict | None] = [
            None if strip_reasoning(r).strip() else (0.0, "no_response") for r in responses
        ]
        todo = [i for i, v in enumerate(verdicts) if v is None]
        answers = run_jobs(
            [{"response": responses[i], "record": task} for i in todo],
            wall_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_bytes=1 << 20,
            parallel=self.parallel,
            function=SCORE,
        )
        for i, answer in zip(todo, answers):
            verdicts[i] = _verdict(answer)
        return verdicts  # type: ignore[return-value]
