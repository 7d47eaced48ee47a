"""The `judge` verifier: each response of a group, reasoning stripped, goes into the template
with the record's prompt (and its answer, as the reference) and to the judge; its reply's
score is the reward. A cached verdict is used again without asking. A group the judge could
not score (dead or timing out past its tries) gets no rewards at all (None, judge_unavailable):
the buffer drops it as unscored and counts it, never a silent 0."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from megatron_rlvr.config.judge import JudgeConfig
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.rewards.judge.client import JudgeCache, JudgeClient, JudgeEndpoint, JudgeUnavailable
from megatron_rlvr.rewards.judge.templates import needs_reference, render, template_text
from megatron_rlvr.rewards.reasoning import strip_reasoning

JudgeVerdict = tuple[float | None, str]  # reward None: the group could not be scored


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """What the judge reads as the prompt: the text, or the chat's messages one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


class JudgeVerifier:
    def __init__(self, cfg: JudgeConfig, endpoint: JudgeEndpoint):
        self.cfg = cfg
        self.template = template_text(cfg)
        self.client = JudgeClient(cfg, endpoint)
        self.cache = JudgeCache(cfg.cache_entries)
        self._counts: Counter[str] = Counter()  # cache hits and dropped groups
        self._lock = threading.Lock()

    def verify_batch(self, responses: list[str], record: PromptRecord) -> list[JudgeVerdict]:
        prompt = prompt_text(record.prompt)
        reference = None if record.answer is None else str(record.answer)
        if reference is None and needs_reference(self.template):
            return [(0.0, "judge_no_reference")] * len(responses)
        verdicts: list[JudgeVerdict | None] = []
        keys: list[str] = []
        for response in responses:
            answer = strip_reasoning(response).strip()
            keys.append(JudgeCache.key(self.template, prompt, reference, answer))
            verdicts.append((0.0, "no_response") if not answer else self.cache.get(keys[-1]))
        hits = sum(v is not None and v[1] != "no_response" for v in verdicts)
        todo = [i for i, v in enumerate(verdicts) if v is None]
        asks = [
            render(
                self.template,
                self.cfg,
                prompt=prompt,
                response=strip_reasoning(responses[i]).strip(),
                reference=reference,
            )
            for i in todo
        ]
        try:
            scored = self.client.score_all(asks)
        except JudgeUnavailable:
            self._add(cache_hits=hits, groups_dropped=1)
            return [(None, "judge_unavailable")] * len(responses)
        for i, verdict in zip(todo, scored):
            verdicts[i] = verdict
            self.cache.put(keys[i], verdict)
        self._add(cache_hits=hits)
        return verdicts  # type: ignore[return-value]

    def _add(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def take_counts(self) -> dict[str, int]:
        """requests, retries, cache_hits and groups_dropped since the last call."""
        counts = self.client.take_counts()
        with self._lock:
            counts.update(self._counts)
            self._counts = Counter()
        return {name: counts[name] for name in ("requests", "retries", "cache_hits", "groups_dropped")}

    def close(self) -> None:
        self.client.close()
