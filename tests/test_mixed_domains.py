"""Mixed-domain runs: one data set mixing math, instruction-following and judged records (each
record's verifier is its domain), mixed by weight per domain with the run's seed, with each
domain's numbers every step and in evaluation."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from judge_fixtures import build_judge_model

from megatron_rlvr.config import ConfigError, load_config
from megatron_rlvr.data.check import load_all
from megatron_rlvr.data.records import DataError, PromptRecord
from megatron_rlvr.data.selection import check_set_names
from megatron_rlvr.rollout.domains import DomainStats

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"


def mixed_file(tmp_path: Path, judged: bool = False) -> Path:
    """12 sums scored by math, 4 by ifeval (the answer must contain the sum's digit: the tiny
    model's vocabulary has no letters, and its rewards vary); `judged`: 4 more by the judge."""
    rows = [
        {"id": f"m{a}{b}", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a in range(4)
        for b in range(3)
    ]
    rows += [
        {
            "id": f"if{a}",
            "prompt": [{"role": "user", "content": f"{a}+1="}],
            "verifier": "ifeval",
            "answer": {"instruction_id_list": ["keywords:existence"], "kwargs": [{"keywords": [str(a + 1)]}]},
        }
        for a in range(4)
    ]
    if judged:
        rows += [
            {
                "id": f"j{a}",
                "prompt": [{"role": "user", "content": f"{a}*2="}],
                "verifier": "judge",
                "answer": str(2 * a),
            }
            for a in range(4)
        ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mixing_weights_per_domain_give_each_its_share_with_the_runs_seed(tmp_path):
    data = ["data.type=file", f"data.path={mixed_file(tmp_path)}"]

    def drawn(*overrides: str) -> list[str]:
        return [r.prompt_id for r in load_all(load_config(TINY, [*data, *overrides]))["data"].records]

    assert Counter(i[:2] for i in drawn()) == {"m0": 3, "m1": 3, "m2": 3, "m3": 3, "if": 4}  # as it is
    even = drawn("data.mixing.math=1", "data.mixing.ifeval=1")
    assert len(even) == 16 and Counter(i.startswith("if") for i in even) == {True: 8, False: 8}
    assert Counter(even)["if0"] == 2  # 8 draws of 4 prompts: each twice
    assert even == drawn("data.mixing.math=1", "data.mixing.ifeval=1")  # a resumed run loads the same list
    assert even != drawn("data.mixing.math=1", "data.mixing.ifeval=1", "trainer.seed=5")  # data.seed follows
    skewed = drawn("data.mixing.math=3", "data.mixing.ifeval=1")
    assert Counter(i.startswith("if") for i in skewed) == {True: 4, False: 12}
    with pytest.raises(DataError, match="data.mixing has no weight for the domain.s. ifeval"):
        drawn("data.mixing.math=1")
    with pytest.raises(DataError, match="data.mixing names code, which no record"):
        drawn("data.mixing.math=1", "data.mixing.ifeval=1", "data.mixing.code=1")
    with pytest.raises(ConfigError, match="data.mixing"):
        load_config(TINY, [*data, "data.mixing.math=0", "data.mixing.ifeval=1"])


def test_domain_stats_name_every_domain_every_step():
    stats = DomainStats(["math", "ifeval", "math"])
    stats.add("math", [1.0, 0.0], "kept")
    stats.add("math", [1.0, 1.0], "zero_std")
    stats.add("math", [], "failed")
    assert stats.take() == {
        "reward/ifeval/samples": 0,
        "reward/ifeval/groups": 0,
        "reward/math/samples": 4,
        "reward/math/groups": 2,
        "reward/math/mean": 0.75,
        "reward/math/zero_std_share": 0.5,
    }
    assert stats.take()["reward/math/samples"] == 0  # since the last take


def test_a_set_may_take_a_domains_name_only_when_it_holds_that_domain_alone():
    def records(*domains: str) -> list[PromptRecord]:
        return [PromptRecord(f"{d}{i}", "1+1=", "2", d) for i, d in enumerate(domains)]

    check_set_names({"math": records("math"), "if": records("ifeval")})
    with pytest.raises(DataError, match="eval.sets.math: a set may take the name of the domain 'math'"):
        check_set_names({"math": records("math", "ifeval")})
    with pytest.raises(DataError, match="eval.sets.math"):
        check_set_names({"math": records("math"), "held": records("math")})


def test_a_mixed_run_shows_each_domain_every_step(tmp_path):
    path = mixed_file(tmp_path, judged=True)
    judge = build_judge_model(tmp_path / "judge")  # a tiny random judge the run serves on the CPU engine
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "train",
            str(TINY),
            f"trainer.output_dir={out}",
            "launch.mode=local",
            "trainer.steps=3",
            "trainer.save_interval=0",
            "buffer.batch_groups=8",
            "buffer.max_staleness=0",  # a step's surplus is stale at the next: every step scores its own groups
            "rollout.n_samples_per_prompt=4",
            "data.type=file",
            f"data.path={path}",
            "data.mixing.math=1",
            "data.mixing.ifeval=1",
            "data.mixing.judge=1",
            f"verifier.judge.model_path={judge}",
            "eval.sets.held.type=file",
            f"eval.sets.held.path={path}",
            "eval.n_samples=2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        for domain in ("math", "ifeval", "judge"):
            assert m[f"reward/{domain}/samples"] > 0 and 0 <= m[f"reward/{domain}/mean"] <= 1, (m["step"], domain)
            assert 0 <= m[f"reward/{domain}/zero_std_share"] <= 1
            assert m[f"verifier/{domain}/failures"] == 0 and m[f"verifier/{domain}/time_s"] > 0
        assert sum(m[f"reward/{d}/samples"] for d in ("math", "ifeval", "judge")) == m["reward/samples"]
    for m in (lines[0], steps[-1]):  # evaluated at step 0 and at the end, per set and per domain
        assert m["eval/held/prompts"] == 20
        assert (m["eval/math/prompts"], m["eval/ifeval/prompts"], m["eval/judge/prompts"]) == (12, 4, 4)
        assert all(0 <= m[f"eval/{d}/pass@1"] <= 1 for d in ("math", "ifeval", "judge"))
        share = (12 * m["eval/math/pass@1"] + 4 * m["eval/ifeval/pass@1"] + 4 * m["eval/judge/pass@1"]) / 20
        assert m["eval/held/pass@1"] == pytest.approx(share)
