"""The LLM judge served by real SGLang 0.5.23 on CPU (.venv-sglang), started as a run starts it
(JudgeHost: the rollout engines' launcher, the run's key, SGLang's tokenizer loaded for chat):
SGLang's structured output (`regex`, xgrammar) makes a tiny random model write `Score: N`, which
is read; unconstrained, its reply does not parse and scores 0 with the reason; a repeat is
answered from the cache; a request without the key is refused; and the server killed, each
request is retried, then the group dropped by the buffer and counted. One server (~25 s to
start on an idle machine), the steps in order."""

from __future__ import annotations

import asyncio
import re
import signal

import httpx
import pytest
from engine_fixtures import sglang_engine
from judge_fixtures import KEY, SCORE, build_judge_model, record

from megatron_rlvr.buffer.buffer import Buffer
from megatron_rlvr.config import VerifierConfig
from megatron_rlvr.config.judge import JudgeConfig
from megatron_rlvr.launch.verifiers import VerifierWorker
from megatron_rlvr.rewards.judge.client import JudgeEndpoint, JudgeRefused
from megatron_rlvr.rewards.judge.serving import JudgeHost
from megatron_rlvr.rewards.judge.verifier import JudgeVerifier
from megatron_rlvr.samples import Group, Sample

pytestmark = pytest.mark.sglang


def test_a_judge_served_by_sglang_scores_caches_requires_the_key_and_its_death_drops_the_group(tmp_path):
    model = build_judge_model(tmp_path / "model")
    cfg = JudgeConfig(model_path=str(model), max_attempts=2, request_timeout_s=60)
    host = JudgeHost(cfg, sglang_engine(), bind="127.0.0.1", log_dir=str(tmp_path / "logs"), api_key=KEY)
    endpoint = host.start()
    try:
        worker = VerifierWorker(VerifierConfig(kind="judge", judge=cfg), {}, endpoint)
        judge = worker.verifiers.judge
        assert judge is not None

        # constrained by SGLang's regex: a score, read and normalised
        verdicts = judge.verify_batch(["four", "it is 4", "5"], record("2+2?", "4"))
        assert [reason for _, reason in verdicts] == ["judge_scored"] * 3
        assert all(r is not None and 0.0 <= r <= 1.0 and (r * 9).is_integer() for r, _ in verdicts)
        reply = httpx.post(
            f"{endpoint.base_url}/chat/completions",
            json={
                "model": endpoint.model,
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 0,
                "max_tokens": 16,
                "regex": SCORE,
            },
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        ).json()
        assert re.fullmatch(SCORE, reply["choices"][0]["message"]["content"]), reply

        # the same responses again: from the cache, no request
        judge.take_counts()
        assert judge.verify_batch(["five", "four"], record("2+2?", "4"))[1] == verdicts[0]
        assert judge.take_counts() == {"requests": 1, "retries": 0, "cache_hits": 1, "groups_dropped": 0}

        # unconstrained, a random model's reply does not parse: 0 with the reason
        free = JudgeVerifier(JudgeConfig(model_path=str(model), constrained=False), endpoint)
        assert free.verify_batch(["four", "five"], record("2+2?", "4")) == [(0.0, "judge_unparsed")] * 2
        free.close()

        # the key is required
        assert httpx.post(f"{endpoint.base_url}/chat/completions", json={}, timeout=30).status_code == 401
        keyless = JudgeVerifier(cfg, JudgeEndpoint(endpoint.base_url, endpoint.model, "not-the-key"))
        with pytest.raises(JudgeRefused, match="refused the key \\(401\\)"):
            keyless.verify_batch(["four"], record("2+2?", "4"))
        keyless.close()

        # the judge killed: each request tried twice, then the group dropped and counted
        worker.take_stats()
        assert host.server is not None and host.server.proc is not None
        host.server.proc.send_signal(signal.SIGKILL)
        host.server.proc.wait(timeout=30)
        rewards = worker.rewards(["six", "seven"], record("2+2?", "4"))
        metrics = worker.take_stats().metrics()
        worker.close()
    finally:
        host.stop()
    assert rewards == [None, None]
    assert metrics["verifier/judge/judge_unavailable"] == 2 and metrics["verifier/judge/retries"] == 2
    assert metrics["verifier/judge/groups_dropped"] == 1
    samples = [Sample("p0", "g0", i, [1], [2], [0.0], "stop", "0", reward=r) for i, r in enumerate(rewards)]
    buffer = Buffer()
    assert asyncio.run(buffer.put(Group("p0", "g0", samples))) == "unscored"
    assert asyncio.run(buffer.stats())["dropped_unscored"] == 1
