"""The verifier registry: each record's verifier scores its group (math, code, the user's own
function in the sandbox), reasoning is stripped, and the metrics count reasons overall and
per verifier."""

import asyncio
import json
import textwrap

import pytest

from megatron_rlvr.config import VerifierConfig
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.launch.placement import InProcess
from megatron_rlvr.launch.verifiers import VerifierPool
from megatron_rlvr.rewards.custom import FunctionSpecError, FunctionVerifier, check_function, resolve_function
from megatron_rlvr.rewards.registry import VerdictStats, Verifiers

USER_MODULE = '''
import json

def exact(response, record):
    """1 when the response is the ground truth, word for word."""
    return float(response.strip() == record["ground_truth"])

def by_length(response, record):
    return len(response) / 10

def raises(response, record):
    raise ValueError("cannot score this")

def hangs(response, record):
    while True:
        pass

def says_yes(response, record):
    return "1.0"

def phones_home(response, record):
    import urllib.request
    return float(urllib.request.urlopen("http://127.0.0.1:9/", timeout=1).status == 200)

def writes_outside(response, record):
    open(record["extra_info"]["target"], "w").write(response)
    return 1.0
'''


@pytest.fixture
def user_module(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    return tmp_path


def test_a_user_function_scores_in_the_sandbox_and_failures_are_zeros_with_reasons(user_module, tmp_path):
    record = PromptRecord("q1", "Say hi", "hi", "custom", extra={"target": str(tmp_path / "pwned")}).to_dict()

    def verify(name, responses):
        spec = resolve_function(f"my_rewards:{name}", user_module)
        return FunctionVerifier(spec, timeout_s=2.0, memory_mb=512, parallel=2).verify_batch(responses, record)

    assert verify("exact", ["hi", " hi\n", "hello"]) == [(1.0, "scored"), (1.0, "scored"), (0.0, "scored")]
    assert verify("by_length", ["12345"]) == [(0.5, "scored")]
    assert verify("raises", ["hi"]) == [(0.0, "runtime_error")]
    assert verify("hangs", ["hi", "hi"]) == [(0.0, "timeout"), (0.0, "timeout")]
    assert verify("says_yes", ["hi"]) == [(0.0, "bad_return")]
    assert verify("phones_home", ["hi"]) == [(0.0, "sandbox_violation")]
    assert verify("writes_outside", ["hi"]) == [(0.0, "sandbox_violation")]
    assert not (tmp_path / "pwned").exists()
    assert verify("missing_function", ["hi"]) == [(0.0, "load_error")]
    by_path = resolve_function("my_rewards.py:exact", user_module)  # a file path works too
    assert FunctionVerifier(by_path, timeout_s=2.0, memory_mb=512).verify_batch(["hi"], record) == [(1.0, "scored")]


def test_function_specs_are_checked_without_running_them(user_module):
    check_function("custom", resolve_function("my_rewards:exact", user_module))
    check_function("custom", resolve_function("my_rewards.py:raises", user_module))
    with pytest.raises(FunctionSpecError, match=r"verifier.functions.custom: .*my_rewards.py defines no 'nope'"):
        check_function("custom", resolve_function("my_rewards:nope", user_module))
    with pytest.raises(FunctionSpecError, match="verifier.functions.custom: no Python module 'not_there'"):
        check_function("custom", resolve_function("not_there:f", user_module))
    with pytest.raises(FunctionSpecError, match="verifier.functions.custom: no file"):
        check_function("custom", resolve_function("gone/file.py:f", user_module))


def test_each_record_goes_to_its_verifier_with_reasoning_stripped(user_module, monkeypatch):
    monkeypatch.chdir(user_module)
    cfg = VerifierConfig(timeout_s=3.0, functions={"exact_words": "my_rewards:exact"})
    verifiers = Verifiers(cfg, {"exact_words": resolve_function("my_rewards:exact", user_module)})
    try:
        math = PromptRecord("m", "2+2=", "4", "math")
        assert verifiers.verify(["<think>maybe 5</think>The answer is \\boxed{4}", "<think>4? or 5", "5"], math) == [
            (1.0, "exact"),
            (0.0, "no_final_answer"),
            (0.0, "numeric_mismatch"),
        ]
        code = PromptRecord("c", "add", json.dumps({"inputs": ["1 2"], "outputs": ["3"]}), "code")
        solution = "<think>```python\nprint(0)\n```</think>```python\nprint(sum(map(int, input().split())))\n```"
        assert verifiers.verify([solution, "print(4)"], code) == [(1.0, "passed"), (0.0, "wrong_answer")]
        own = PromptRecord("u", "Say hi", "hi", "exact_words")
        assert verifiers.verify(["hi", "bye"], own) == [(1.0, "scored"), (0.0, "scored")]
    finally:
        verifiers.close()


def test_metrics_count_reasons_overall_and_per_verifier():
    stats = VerdictStats()
    stats.add("math", [(1.0, "exact"), (0.0, "timeout")], 0.5)
    other = VerdictStats()
    other.add("code", [(0.0, "timeout"), (1.0, "passed"), (1.0, "passed")], 0.25)
    other.add("math", [(0.0, "wrong_answer")], 0.125)
    stats.merge(other)
    assert stats.metrics() == {
        "verifier/exact": 1,
        "verifier/passed": 2,
        "verifier/timeout": 2,
        "verifier/wrong_answer": 1,
        "verifier/code/samples": 3,
        "verifier/code/reward_mean": pytest.approx(2 / 3),
        "verifier/code/failures": 1,  # a timeout is no verdict on the answer; a wrong answer is one
        "verifier/code/time_s": 0.25,
        "verifier/code/passed": 2,
        "verifier/code/timeout": 1,
        "verifier/math/samples": 3,
        "verifier/math/reward_mean": pytest.approx(1 / 3),
        "verifier/math/failures": 1,
        "verifier/math/time_s": 0.625,
        "verifier/math/exact": 1,
        "verifier/math/timeout": 1,
        "verifier/math/wrong_answer": 1,
    }


def test_the_local_pool_scores_and_evaluation_does_not_count(tmp_path, monkeypatch):
    from megatron_rlvr.config import Config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "words.py").write_text(
        textwrap.dedent("""
        def yes(response, record):
            return 1.0
    """)
    )
    cfg = Config.model_validate({"verifier": {"functions": {"yes": "words:yes"}, "num_workers": 1}})
    pool = VerifierPool(cfg, InProcess(cfg))
    try:
        record = PromptRecord("u", "q", None, "yes")
        assert asyncio.run(pool(["a", "b"], record)) == [1.0, 1.0]
        assert asyncio.run(pool(["c"], record, count=False)) == [1.0]
        metrics = pool.take_metrics()
        assert metrics.pop("verifier/yes/time_s") > 0  # the counted call's time in the worker
        assert metrics == {
            "verifier/scored": 2,
            "verifier/yes/samples": 2,
            "verifier/yes/reward_mean": 1.0,
            "verifier/yes/failures": 0,
            "verifier/yes/scored": 2,
        }
        assert pool.take_metrics() == {}
    finally:
        pool.close()
