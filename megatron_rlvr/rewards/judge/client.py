"""Requests to the judge: OpenAI's chat API through the `openai` client (SGLang's
/v1/chat/completions, the CPU engine's, or an external endpoint), greedy with a fixed seed,
the reply constrained to the score format where configured; at most `concurrency` in flight;
each retried up to `max_attempts` times when the judge is unreachable, times out or fails
(5xx, 429), then given up (JudgeUnavailable). A refused key is the user's to fix: one line
(JudgeRefused); so is a refused request before the judge has answered any (a setting it does
not take), while one refused after that is that request's fault (longer than the judge's
context, say): 0 with judge_bad_request. Verdicts are cached by (template, prompt, reference,
response) in the verifier."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai

from megatron_rlvr.config.judge import JudgeConfig
from megatron_rlvr.errors import UserError
from megatron_rlvr.rewards.judge.templates import read_score, score_regex

RETRY_PAUSE_S = (0.5, 1.0, 2.0, 4.0)  # before the 2nd, 3rd, ... try (the last repeats)


class JudgeRefused(UserError):
    """The judge refused the key or the request: retrying cannot help."""


class JudgeUnavailable(RuntimeError):
    """The judge did not answer within max_attempts tries."""


@dataclass(frozen=True)
class JudgeEndpoint:
    """Where the judge answers: base_url ends in /v1; api_key None: the server checks none."""

    base_url: str
    model: str
    api_key: str | None


def judge_endpoint(cfg: JudgeConfig) -> JudgeEndpoint:
    """An external judge's endpoint, its key read now from the variable api_key_env names."""
    import os

    key = os.environ.get(cfg.api_key_env or "")
    if not key:
        raise JudgeRefused(f"verifier.judge.api_key_env = {cfg.api_key_env!r}: that environment variable is not set")
    assert cfg.base_url is not None and cfg.model is not None, "an external judge has both (checked by the config)"
    return JudgeEndpoint(cfg.base_url, cfg.model, key)


class JudgeCache:
    """Verdicts by key, the oldest dropped beyond `entries` (0: nothing kept)."""

    def __init__(self, entries: int):
        self.entries = entries
        self._store: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(*parts: str | None) -> str:
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def get(self, key: str) -> tuple[float, str] | None:
        with self._lock:
            verdict = self._store.get(key)
            if verdict is not None:
                self._store.move_to_end(key)
            return verdict

    def put(self, key: str, verdict: tuple[float, str]) -> None:
        if self.entries == 0:
            return
        with self._lock:
            self._store[key] = verdict
            self._store.move_to_end(key)
            while len(self._store) > self.entries:
                self._store.popitem(last=False)


class JudgeClient:
    """Scores judge prompts (rendered templates) through one endpoint; counts requests,
    retries and replies for the run's metrics."""

    def __init__(self, cfg: JudgeConfig, endpoint: JudgeEndpoint, sleep: Callable[[float], None] = time.sleep):
        self.cfg, self.endpoint, self._sleep = cfg, endpoint, sleep
        self._client = openai.OpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key or "none",
            timeout=cfg.request_timeout_s,
            max_retries=0,  # retries are ours: bounded, counted
        )
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="judge")
        self._extra = {"regex": score_regex(cfg)} if cfg.constrained else None
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._answered = False  # a request was answered: from then on a refused one is that request's fault

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def take_counts(self) -> Counter[str]:
        with self._lock:
            counts, self.counts = self.counts, Counter()
        return counts

    def score_all(self, prompts: list[str]) -> list[tuple[float, str]]:
        """(reward, reason) per judge prompt, at most `concurrency` at once; JudgeUnavailable
        when any of them could not be scored (the group is dropped whole)."""
        return list(self._pool.map(self._score, prompts))

    def _score(self, prompt: str) -> tuple[float, str]:
        last = ""
        for attempt in range(self.cfg.max_attempts):
            if attempt:
                self._count("retries")
                self._sleep(RETRY_PAUSE_S[min(attempt - 1, len(RETRY_PAUSE_S) - 1)])
            self._count("requests")
            try:
                reply = self._client.chat.completions.create(
                    model=self.endpoint.model,
                    messages=[{"role": "user", "content": prompt}],
                    temperature=0.0,
                    seed=self.cfg.seed,
                    max_tokens=self.cfg.max_tokens,
                    n=1,
                    extra_body=self._extra,
                )
            except (openai.AuthenticationError, openai.PermissionDeniedError) as err:
                raise JudgeRefused(
                    f"the judge at {self.endpoint.base_url} refused the key ({err.status_code}): a served judge "
                    "takes the run's key; an external one the key in verifier.judge.api_key_env"
                ) from err
            except openai.BadRequestError as err:
                if self._answered:  # it took requests before: this one's fault (too long for its context, say)
                    return 0.0, "judge_bad_request"
                raise JudgeRefused(
                    f"the judge at {self.endpoint.base_url} refused the request: {_message(err)}"
                    + ("; if it cannot constrain output, set verifier.judge.constrained = false" if self._extra else "")
                ) from err
            except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as err:
                last = f"{type(err).__name__}: {_message(err)}"  # APITimeoutError is a connection error
                continue
            except openai.APIStatusError as err:
                last = f"HTTP {err.status_code}: {_message(err)}"
                continue
            self._answered = True
            return read_score(reply.choices[0].message.content or "", self.cfg)
        raise JudgeUnavailable(f"no answer from the judge after {self.cfg.max_attempts} tries ({last})")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _message(err: openai.APIError) -> str:
    body: dict = err.body if isinstance(err.body, dict) else {}
    inner: dict = body["error"] if isinstance(body.get("error"), dict) else body
    return (str(inner.get("message") or err.message).splitlines() or [""])[0][:300]
