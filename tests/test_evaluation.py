"""Evaluation while training: pass@k is the unbiased estimator on cases worked by hand; a
seeded run's step-0 evaluation is the same whether or not training follows it; and training
is the same with evaluation on or off."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.evaluation import pass_at_k, summarize

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 1 / 4),  # one draw: the fraction correct
        (4, 1, 2, 1 / 2),  # 1 − C(3,2)/C(4,2) = 1 − 3/6
        (5, 2, 3, 9 / 10),  # 1 − C(3,3)/C(5,3) = 1 − 1/10
        (10, 3, 2, 8 / 15),  # 1 − C(7,2)/C(10,2) = 1 − 21/45
        (16, 0, 8, 0.0),
        (16, 16, 1, 1.0),
        (8, 6, 4, 1.0),  # n − c = 2 < k: every draw of 4 holds a correct one
        (3, 1, 3, 1.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_failed_groups_count_as_wrong_and_are_counted():
    """Two prompts scored (all right, all wrong) and two whose groups failed: pass@k and avg@n
    over all four, not over the two that came back."""
    scored = [([1.0, 1.0], [3, 4], [False, False]), ([0.0, 0.0], [2, 2], [False, True])]
    out = summarize("eval/held", scored, 2, 2, [1, 2])
    assert out == {
        "eval/held/prompts": 4,
        "eval/held/failed": 2,
        "eval/held/pass@1": 0.25,
        "eval/held/pass@2": 0.25,
        "eval/held/avg@2": 0.25,
        "eval/held/response_length": 2.75,
        "eval/held/truncated": 0.25,
    }
    assert summarize("eval/held", [], 3, 2, [1]) == {
        "eval/held/prompts": 3,
        "eval/held/failed": 3,
        "eval/held/pass@1": 0.0,
        "eval/held/avg@2": 0.0,
    }
    assert summarize("eval/held", scored, 0, 2, [1])["eval/held/pass@1"] == 0.5


def test_eval_config_is_checked():
    with pytest.raises(Exception, match=r"eval.pass_k = \[8\]: k must be <= eval.n_samples \(4\)"):
        load_config(TINY, ["eval.n_samples=4", "eval.pass_k=[8]"])
    cfg = load_config(TINY, ["eval.sets.held.type=arithmetic", "eval.interval=5", "eval.n_samples=8"])
    assert cfg.eval.sets["held"].num_prompts == 512


EVAL = (
    "eval.sets.held.type=arithmetic",
    "eval.sets.held.num_prompts=24",
    "eval.sets.held.seed=7",
    "eval.n_samples=4",
    "eval.temperature=1.0",
    "eval.interval=2",
)
SHORT = (
    "launch.mode=local",
    "trainer.steps=3",
    "trainer.save_interval=0",
    "buffer.batch_groups=4",
    "rollout.n_samples_per_prompt=4",
)


def run(tmp_path, name, *overrides) -> tuple[list[dict], str]:
    out = tmp_path / name
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "train",
            str(TINY),
            f"trainer.output_dir={out}",
            *SHORT,
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], done.stderr


def mixed_data(tmp_path) -> tuple[str, ...]:
    """Training data whose records name three verifiers: math, code (tests the tiny model
    never passes) and a function of the user's (distinct characters: rewards that vary, so
    its groups train)."""
    (tmp_path / "my_rewards.py").write_text("def distinct(response, record):\n    return len(set(response)) / 3\n")
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)} for a in range(4) for b in range(3)
    ]
    rows += [
        {"prompt": "1+2=", "answer": {"inputs": ["1 2"], "outputs": ["3"]}, "verifier": "code"},
        {"prompt": [{"role": "user", "content": "3*3="}], "verifier": "distinct", "id": "mine"},
        {"prompt": [{"role": "user", "content": "2*3="}], "verifier": "distinct", "id": "mine too"},
    ]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return (
        "data.type=file",
        f"data.path={tmp_path / 'mixed.jsonl'}",
        f"verifier.functions.distinct={tmp_path / 'my_rewards.py'}:distinct",
    )


def test_evaluation_changes_nothing_a_seeded_run_trains_on(tmp_path):
    data = mixed_data(tmp_path)
    with_eval, log = run(tmp_path, "with-eval", *data, *EVAL)
    without, _ = run(tmp_path, "without-eval", *data)
    trained = with_eval[1:]
    assert {"verifier/code/samples", "verifier/distinct/samples", "verifier/math/samples"} <= {
        k for m in trained for k in m
    }
    assert all(
        m.get("verifier/distinct/scored", 0) == m.get("verifier/distinct/samples", 0) for m in trained
    )  # every call of the user's function scored, none failed
    assert with_eval[0]["data/prompts"] == 15 and with_eval[0]["data/skipped_rows"] == 0
    assert [m["step"] for m in with_eval] == [0, 1, 2, 3]
    evaluated = {m["step"]: {k: v for k, v in m.items() if k.startswith("eval/held/")} for m in with_eval}
    assert set(evaluated[0]) == {
        f"eval/held/{k}" for k in ("prompts", "failed", "pass@1", "pass@4", "avg@4", "response_length", "truncated")
    }
    assert evaluated[1] == {} and evaluated[2] and evaluated[3]  # step 0, every 2 steps, the end
    for metrics in evaluated.values():
        if metrics:
            assert metrics["eval/held/prompts"] == 24 and metrics["eval/held/failed"] == 0
            assert 0 <= metrics["eval/held/pass@1"] <= metrics["eval/held/pass@4"] <= 1
            assert metrics["eval/held/avg@4"] == pytest.approx(metrics["eval/held/pass@1"])  # 0/1 rewards
            assert 0 < metrics["eval/held/response_length"] <= 3 and 0 <= metrics["eval/held/truncated"] <= 1
    assert "eval at step 0: held pass@1" in log and "eval=" in log  # its line, and the progress bar
    # The same groups, samples, rewards and counts; the learner's numbers up to the float
    # rounding of rollout logprobs that depends on how the engine batched (as in test_train_e2e).
    timing = {
        "time/step_s",
        "weight_sync/seconds",
        *(f"verifier/{name}/time_s" for name in ("math", "code", "distinct")),
        "time/eval_s",
        "loop/tokens_per_s",
        "loop/engine_busy_fraction",
        "loop/learner_busy_fraction",
    }
    noise = {"weight_sync/parity_max_gap", "train/mismatch_abs_max", "train/mismatch_abs_mean", "train/mismatch_k3_kl"}
    assert len(without) == len(trained)
    for a, b in zip(trained, without):  # (data/* counts ride on the first line each run writes)
        a = {k: v for k, v in a.items() if k.split("/")[0] not in ("eval", "data") and k not in timing}
        b = {k: v for k, v in b.items() if k.split("/")[0] != "data" and k not in timing}
        assert set(a) == set(b)
        for key in set(a) - noise:
            exact = isinstance(a[key], int) or key.split("/")[0] in ("reward", "buffer", "verifier", "rollout")
            assert a[key] == (b[key] if exact else pytest.approx(b[key], rel=1e-5, abs=1e-7)), (a["step"], key)
        for key in noise:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)

    alone = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "eval_only.py"),
            str(TINY),
            f"trainer.output_dir={tmp_path / 'alone'}",
            *SHORT,
            *data,
            *EVAL,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert alone.returncode == 0, alone.stderr[-4000:]
    step0 = json.loads(alone.stdout.strip().splitlines()[-1])
    step0.pop("time/eval_s")
    assert step0 == {k: v for k, v in with_eval[0].items() if k.startswith("eval/")}  # per set and domain, as trained
