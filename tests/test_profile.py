"""`megatron-rlvr profile`: the shares of all-wrong, all-right and mixed groups per domain from
the run's own engines and verifiers (a verifier whose outcomes are known gives the exact
shares), the generation they imply, the difficulty file, and the skip that reads it."""

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.data.check import load_all
from megatron_rlvr.data.records import DataError
from megatron_rlvr.data.selection import Difficulty, read_difficulty, write_difficulty
from megatron_rlvr.profile import DomainProfile, outcome_of, summarize, table, wait_for_group, wilson
from megatron_rlvr.stopping import StopRequested, StopSignals

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"

# Rewards known whatever the model writes: 1, 0, or a uniform draw (a group of such rewards is
# never all equal). Two functions: two domains.
KNOWN = """
import random

def _reward(record):
    return {"right": 1.0, "wrong": 0.0}.get(record["ground_truth"], None)

def known(response, record):
    reward = _reward(record)
    return random.random() if reward is None else reward

def other(response, record):
    return known(response, record)
"""
ROWS = [  # (verifier, outcome): known 1 right, 2 wrong, 1 mixed; other 1 right, 1 mixed
    ("known", "right"),
    ("known", "wrong"),
    ("known", "wrong"),
    ("known", "mixed"),
    ("other", "right"),
    ("other", "mixed"),
]


def known_data(tmp_path: Path) -> list[str]:
    (tmp_path / "known.py").write_text(KNOWN)
    rows = [
        {"id": f"p{i}", "prompt": f"{i}+1=", "answer": answer, "verifier": verifier}
        for i, (verifier, answer) in enumerate(ROWS)
    ]
    (tmp_path / "known.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "data.type=file",
        f"data.path={tmp_path / 'known.jsonl'}",
        f"verifier.functions.known={tmp_path / 'known.py'}:known",
        f"verifier.functions.other={tmp_path / 'known.py'}:other",
    ]


def test_the_profile_of_known_outcomes_gives_the_exact_shares_and_a_difficulty_file(tmp_path):
    out = tmp_path / "difficulty.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "profile",
            str(TINY),
            f"trainer.output_dir={tmp_path / 'run'}",
            "launch.mode=local",
            "buffer.batch_groups=4",
            *known_data(tmp_path),
            "--n",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "| known | 4 | 50.0% | 25.0% | 25.0% | 4.0 (1.4–21.9) | 16 |" in lines, done.stdout
    assert "| other | 2 | 0.0% | 50.0% | 50.0% | 2.0 (1.1–10.6) | 8 |" in lines, done.stdout
    assert "| all | 6 | 33.3% | 33.3% | 33.3% | 3.0 (1.4–10.3) | 12 |" in lines, done.stdout
    rows = read_difficulty(out)
    assert {i: (r.domain, r.outcome, r.n) for i, r in rows.items()} == {
        f"p{i}": (verifier, {"right": "all_right", "wrong": "all_wrong"}.get(a, "mixed"), 4)
        for i, (verifier, a) in enumerate(ROWS)
    }
    assert rows["p0"].pass_rate == 1.0 and rows["p1"].pass_rate == 0.0 and 0 < rows["p3"].mean_reward < 1

    # the skip reads it: all-wrong, all-right or both of the profiled prompts are never drawn
    data = [*known_data(tmp_path), f"data.difficulty_file={out}"]

    def kept(skip: str) -> set[str]:
        cfg = load_config(TINY, [*data, f"data.difficulty_skip={skip}"])
        return {r.prompt_id for r in load_all(cfg)["data"].records}

    left = {skip: kept(skip) for skip in ("all_wrong", "all_right", "both")}
    assert left == {"all_wrong": {"p0", "p3", "p4", "p5"}, "all_right": {"p1", "p2", "p3", "p5"}, "both": {"p3", "p5"}}


def test_outcomes_follow_the_buffers_zero_std_rule():
    assert outcome_of([1.0, 1.0], 1e-6) == "all_right"
    assert outcome_of([0.0, 0.0, 0.0], 1e-6) == "all_wrong"
    assert outcome_of([0.5, 0.5], 1e-6) == "all_right"  # equal partial credit: no gradient either
    assert outcome_of([0.0, 1.0], 1e-6) == "mixed"
    assert outcome_of([0.3, 0.3 + 1e-9], 1e-6) == "all_right"  # within the buffer's eps


def test_the_generation_a_useful_group_costs_and_its_bound():
    low, high = wilson(186, 1000)  # NeMo-Gym's IF profile of Qwen3-30B-A3B: 18.6% mixed
    assert low == pytest.approx(0.1631, abs=1e-4) and high == pytest.approx(0.2113, abs=1e-4)
    profile = DomainProfile("ifeval", {"all_wrong": 546, "all_right": 268, "mixed": 186})
    assert profile.groups_per_useful() == pytest.approx((1 / high, 1000 / 186, 1 / low))
    none_useful = DomainProfile("code", {"all_wrong": 5})
    assert none_useful.groups_per_useful()[1:] == (math.inf, math.inf)
    text = table([profile, none_useful], n=8, batch_groups=32)
    assert "| ifeval | 1000 | 54.6% | 26.8% | 18.6% | 5.4 (4.7–6.1) | 173 |" in text
    assert "| code | 5 | 100.0% | 0.0% | 0.0% | ∞ (2.3–∞) | ∞ |" in text


def test_one_domain_has_no_all_row_and_several_have_one():
    rows = [Difficulty("a", "math", 4, 0.0, 0.0, "all_wrong"), Difficulty("b", "math", 4, 0.5, 0.5, "mixed")]
    assert [p.domain for p in summarize(rows)] == ["math"]
    rows.append(Difficulty("c", "ifeval", 4, 1.0, 1.0, "all_right"))
    assert [(p.domain, p.prompts) for p in summarize(rows)] == [("ifeval", 1), ("math", 2), ("all", 3)]
    mixed = summarize(rows, {"math": 1.0, "ifeval": 3.0})[-1]  # drawn 1:3, whatever the prompts' counts
    assert mixed.domain == "as mixed" and mixed.prompts == 3
    assert [mixed.share(o) for o in ("all_wrong", "all_right", "mixed")] == [0.125, 0.75, 0.125]
    assert mixed.groups_per_useful()[1] == 8.0


def test_a_bad_difficulty_file_or_one_that_skips_everything_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "n": 4, "pass_rate": 0.5, "outcome": "mixed"}\n{"id": "b", "n": 4}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a difficulty row .*pass_rate"):
        read_difficulty(bad)
    bad.write_text('{"id": "a", "n": 4, "pass_rate": 0.5, "outcome": "easy"}\n')
    with pytest.raises(DataError, match="outcome 'easy' is not one of all_wrong, all_right, mixed"):
        read_difficulty(bad)
    with pytest.raises(DataError, match="no such file .*megatron-rlvr profile"):
        read_difficulty(tmp_path / "none.jsonl")
    every = tmp_path / "every.jsonl"
    write_difficulty(every, [Difficulty(f"arith-{i}", "math", 4, 0.0, 0.0, "all_wrong") for i in range(8)])
    cfg = load_config(TINY, ["data.num_prompts=8", f"data.difficulty_file={every}"])
    with pytest.raises(DataError, match="skips every prompt of the data"):
        load_all(cfg)


def test_waiting_for_groups_ends_on_a_stop_request_or_at_its_bound():
    async def wait(stop: StopSignals, wait_s: float):
        return await wait_for_group(asyncio.Queue(), wait_s, stop)

    stop = StopSignals()
    stop.request("SIGTERM")
    with pytest.raises(StopRequested, match="stopped by SIGTERM while profiling"):
        asyncio.run(wait(stop, 3600.0))  # seen at once, not after the hour
    with pytest.raises(TimeoutError, match="no group came back from the engines in 0 s"):
        asyncio.run(wait(StopSignals(), 0.2))
