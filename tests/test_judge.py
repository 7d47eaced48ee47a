"""The LLM judge (verifier `judge`) served on CPU by the CPU engine, started by the project's
launcher with a key, on a tiny random model with a character tokenizer: the score format
constrained by masking (a random model writes it only so), an unconstrained reply that does not
parse scored 0 with its reason, the cache hit on a repeat, a killed judge retried and then its
group dropped by the buffer and counted, the key required; and the pieces on their own (the
score reading, the regex subset, the config's checks)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import psutil
import pytest
import torch
from engine_fixtures import REPO
from judge_fixtures import KEY, SCORE, build_judge_model, record

from megatron_rlvr.buffer.buffer import Buffer
from megatron_rlvr.config import CpuEngine, VerifierConfig, load_config
from megatron_rlvr.config.base import ConfigError
from megatron_rlvr.config.judge import JudgeConfig
from megatron_rlvr.launch.verifiers import VerifierWorker
from megatron_rlvr.rewards.judge.client import JudgeEndpoint, JudgeRefused, judge_endpoint
from megatron_rlvr.rewards.judge.serving import JudgeHost
from megatron_rlvr.rewards.judge.templates import read_score, score_regex
from megatron_rlvr.rewards.judge.verifier import JudgeVerifier
from megatron_rlvr.rollout.cpu_engine import EngineError
from megatron_rlvr.rollout.openai_api import TokenConstraint, TokenTrie, regex_matches
from megatron_rlvr.rollout.protocol import SamplingParams
from megatron_rlvr.rollout.sampling import sample_rows
from megatron_rlvr.samples import Group, Sample


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    return build_judge_model(tmp_path_factory.mktemp("judge-model"))


def _host(judge_model, log_dir) -> JudgeHost:
    return JudgeHost(
        JudgeConfig(model_path=str(judge_model)), CpuEngine(), bind="127.0.0.1", log_dir=str(log_dir), api_key=KEY
    )


@pytest.fixture(scope="module")
def judge_server(judge_model, tmp_path_factory):
    """The judge served as a run serves it (JudgeHost: the launcher, the key)."""
    host = _host(judge_model, tmp_path_factory.mktemp("judge-logs"))
    host.start()
    yield host.server
    host.stop()


def _cfg(model_dir, **fields) -> JudgeConfig:
    return JudgeConfig(model_path=str(model_dir), max_attempts=2, request_timeout_s=30, **fields)


def _endpoint(server, model_dir, key=KEY) -> JudgeEndpoint:
    return JudgeEndpoint(f"{server.url}/v1", str(model_dir), key)


def test_the_constrained_judge_writes_a_score_that_is_read_and_normalised(judge_model, judge_server):
    cfg = _cfg(judge_model)
    client = openai.OpenAI(base_url=f"{judge_server.url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="judge",
        messages=[{"role": "user", "content": "Grade: 2+2=4"}],
        temperature=0,
        seed=0,
        max_tokens=16,
        extra_body={"regex": score_regex(cfg)},
    )
    assert re.fullmatch(SCORE, reply.choices[0].message.content) and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(reply.choices[0].message.content) + 1  # the characters, then <eos>

    verifier = JudgeVerifier(cfg, _endpoint(judge_server, judge_model))
    try:
        verdicts = verifier.verify_batch(["four", "it is 4", "5", "<think>hm</think>"], record("2+2?", "4"))
    finally:
        verifier.close()
    assert [reason for _, reason in verdicts] == ["judge_scored"] * 3 + ["no_response"]
    for reward, _ in verdicts[:3]:
        assert reward is not None and 0.0 <= reward <= 1.0 and (reward * 9).is_integer()
    assert verifier.take_counts()["requests"] == 3  # the empty answer is not sent


def test_an_unconstrained_reply_that_does_not_parse_scores_zero_with_its_reason(judge_model, judge_server):
    verifier = JudgeVerifier(_cfg(judge_model, constrained=False), _endpoint(judge_server, judge_model))
    try:
        verdicts = verifier.verify_batch(["four", "it is 4"], record("2+2?", "4"))
    finally:
        verifier.close()
    assert verdicts == [(0.0, "judge_unparsed")] * 2  # a random model writes no `Score: N`


def test_a_repeat_is_answered_from_the_cache(judge_model, judge_server):
    verifier = JudgeVerifier(_cfg(judge_model, template="open_ended"), _endpoint(judge_server, judge_model))
    try:
        first = verifier.verify_batch(["a", "b", "c"], record("Say hi", None))
        assert verifier.take_counts() == {"requests": 3, "retries": 0, "cache_hits": 0, "groups_dropped": 0}
        again = verifier.verify_batch(["c", "a", "d"], record("Say hi", None))
        assert verifier.take_counts() == {"requests": 1, "retries": 0, "cache_hits": 2, "groups_dropped": 0}
        other_prompt = verifier.verify_batch(["a"], record("Say bye", None))
        assert verifier.take_counts()["cache_hits"] == 0 and len(other_prompt) == 1
    finally:
        verifier.close()
    assert again[:2] == [first[2], first[0]]


def test_the_key_is_required(judge_model, judge_server):
    assert httpx.post(f"{judge_server.url}/v1/chat/completions", json={"messages": []}).status_code == 401
    for key in (None, "not-the-key"):
        verifier = JudgeVerifier(_cfg(judge_model), _endpoint(judge_server, judge_model, key))
        try:
            with pytest.raises(JudgeRefused, match="refused the key \\(401\\)") as err:
                verifier.verify_batch(["four"], record("2+2?", "4"))
        finally:
            verifier.close()
        assert "\n" not in str(err.value)


def test_a_refused_request_stops_the_run_until_the_judge_has_answered_one_then_scores_zero(judge_model, judge_server):
    """Refused first: a setting the judge does not take (one line); refused after answers: that
    request's fault, here a response longer than the judge's context."""
    too_long = "x" * 5000  # the judge model's context is 4096 characters
    verifier = JudgeVerifier(_cfg(judge_model), _endpoint(judge_server, judge_model))
    try:
        with pytest.raises(
            JudgeRefused, match="refused the request: messages: the prompt .* fills the model's context"
        ):
            verifier.verify_batch([too_long], record("2+2?", "4"))
        assert verifier.verify_batch(["four"], record("2+2?", "4"))[0][1] == "judge_scored"
        assert verifier.verify_batch([too_long, "five"], record("2+2?", "4"))[0] == (0.0, "judge_bad_request")
    finally:
        verifier.close()


def test_a_killed_judge_is_retried_then_its_group_dropped_and_counted(judge_model, tmp_path):
    host = _host(judge_model, tmp_path)
    try:
        worker = VerifierWorker(VerifierConfig(kind="judge", judge=_cfg(judge_model)), {}, host.start())
        server = host.server
        assert server is not None and server.proc is not None
        assert None not in worker.rewards(["four", "five"], record("2+2?", "4"))
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
        rewards = worker.rewards(["six", "seven", "eight"], record("2+2?", "4"))
        metrics = worker.take_stats().metrics()
        worker.close()
    finally:
        host.stop()
    assert rewards == [None] * 3
    assert metrics["verifier/judge/judge_unavailable"] == 3 and metrics["verifier/judge/judge_scored"] == 2
    assert metrics["verifier/judge/retries"] == 3  # each of the 3 tried twice (max_attempts = 2)
    assert metrics["verifier/judge/groups_dropped"] == 1

    buffer = Buffer()
    samples = [Sample("p0", "g0", i, [1], [2], [0.0], "stop", "0", reward=r) for i, r in enumerate(rewards)]
    group = Group("p0", "g0", samples)
    assert asyncio.run(buffer.put(group)) == "unscored"
    assert asyncio.run(buffer.stats())["dropped_unscored"] == 1


def test_the_cpu_engines_chat_endpoint_refuses_what_it_cannot_honour(judge_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{judge_server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "x"}]
    for extra, message in [
        ({"regex": "Score: [0-9]+"}, "'+' is not supported"),
        ({"json_schema": "{}"}, "json_schema: the CPU engine honours only `regex`"),
        ({"response_format": {"type": "json_object"}}, "response_format: the CPU engine honours only"),
        ({"stream": True}, "stream: streaming is not supported"),
        ({"logit_bias": {}}, "logit_bias: unknown field"),
    ]:
        reply = httpx.post(url, json={"messages": messages, **extra}, headers=headers)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], (extra, reply.text)


def test_the_score_is_read_from_the_reply():
    cfg = JudgeConfig(base_url="http://x/v1", model="m", api_key_env="K", min_score=1, max_score=5)
    assert read_score("Score: 5", cfg) == (1.0, "judge_scored")
    assert read_score("thinking... Score: 2 no wait Score: 3", cfg) == (0.5, "judge_scored")
    assert read_score("Score: 6", cfg) == (0.0, "judge_out_of_range")
    assert read_score("five out of five", cfg) == (0.0, "judge_unparsed")
    assert regex_matches(score_regex(cfg)) == [f"Score: {n}" for n in range(1, 6)]


def test_the_regex_subset_expands_to_every_match_or_is_refused():
    expected = {f"A{d}{dot}{t}" for d in "012" for dot in ("", ".") for t in ("x", "yz")}
    assert sorted(regex_matches(r"A[0-2]\.?(?:x|yz)")) == sorted(expected)
    assert regex_matches(r"\d") == list("0123456789")
    for pattern in ("a*", "[^a]", "(ab", "a{2}", "."):
        with pytest.raises(EngineError, match="finitely many matches"):
            regex_matches(pattern)


def test_the_judge_config_is_checked_in_one_line_per_problem(judge_model, tmp_path):
    with pytest.raises(ValueError, match="give exactly one of model_path"):
        JudgeConfig(model_path=str(judge_model), base_url="http://x/v1")
    with pytest.raises(ValueError) as err:
        JudgeConfig(base_url="http://x/v1", min_score=5, max_score=5, template=str(tmp_path / "none.txt"))
    assert str(err.value).count("verifier.judge") == 4  # model, api_key_env, the range, the template
    with pytest.raises(ValueError, match="api_key_env: a judge served by the run uses the run's own key"):
        JudgeConfig(model_path=str(judge_model), api_key_env="K")
    bad = tmp_path / "t.txt"
    bad.write_text("no placeholder")
    with pytest.raises(ValueError, match="no \\{response\\} placeholder"):
        JudgeConfig(model_path=str(judge_model), template=str(bad))
    with pytest.raises(ValueError, match="unknown verifier"):
        VerifierConfig(kind="judge")  # a record may name `judge` only when a judge is configured
    cfg = JudgeConfig(base_url="http://x/v1", model="m", api_key_env="RLVR_TEST_JUDGE_KEY")
    assert "RLVR_TEST_JUDGE_KEY" not in os.environ
    with pytest.raises(JudgeRefused, match="RLVR_TEST_JUDGE_KEY.*not set"):
        judge_endpoint(cfg)
    os.environ["RLVR_TEST_JUDGE_KEY"] = "secret"
    try:
        assert judge_endpoint(cfg) == JudgeEndpoint("http://x/v1", "m", "secret")
    finally:
        del os.environ["RLVR_TEST_JUDGE_KEY"]


@pytest.mark.slow
def test_a_run_serves_its_judge_and_the_judge_scores_its_groups(judge_model, tmp_path):
    """`megatron-rlvr train` with the arithmetic records judged: the run starts the judge's
    engine with its key, the verifier workers score through it, and nothing is left running."""
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "train",
            str(REPO / "configs" / "tiny-moe-cpu.yaml"),
            f"trainer.output_dir={out}",
            "trainer.steps=2",
            "buffer.batch_groups=2",
            "rollout.n_samples_per_prompt=4",
            "launch.mode=local",
            "verifier.by_data_source={arithmetic: judge}",
            f"verifier.judge.model_path={judge_model}",
            "verifier.judge.max_tokens=16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert m["verifier/judge/requests"] == m["verifier/judge/judge_scored"] > 0
        assert m["verifier/judge/groups_dropped"] == 0
    left = [p for p in psutil.process_iter(["cmdline"]) if str(judge_model) in " ".join(p.info["cmdline"] or [])]
    assert not left


def test_the_engines_sampler_draws_only_what_a_constraint_allows_greedy_or_sampled():
    trie = TokenTrie([[5, 6], [5, 7], [9]], end_ids={2})
    gen = torch.Generator().manual_seed(0)
    for seed in range(20):
        params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 1.0)]
        for p in params[:2]:
            p._constraint = TokenConstraint(trie)
        written: list[list[int]] = [[], [], []]
        for step in range(3):
            allowed = [trie.allowed(p._constraint.node) for p in params[:2]]
            tokens, logprobs = sample_rows(
                torch.randn(3, 16, generator=gen), params, [seed, seed + 1, seed + 2], [step] * 3
            )
            for row in range(2):
                assert tokens[row] in allowed[row] and logprobs[row] > float("-inf")
            for row, token in enumerate(tokens):
                written[row].append(token)
        for row in range(2):  # a whole match, then the end (or more of a longer one)
            reply = written[row][: written[row].index(2)] if 2 in written[row] else written[row]
            assert reply in ([5, 6], [5, 7], [9]), reply


def test_a_judge_served_by_sglang_on_cuda_needs_gpus_of_its_own(judge_model):
    overrides = ["rollout.engine.type=sglang", "parallel.device=cuda", f"verifier.judge.model_path={judge_model}"]
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "tiny-moe-cpu.yaml", overrides)
    assert "verifier.judge.gpus: a judge served by SGLang on CUDA needs GPU ids of its own" in err.value.problems
