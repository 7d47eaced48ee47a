"""benchmarks/compare_replay_long.py turns the grid's finished runs into a verdict on each of
Zheng et al.'s four findings by explicit rules: two seeds at least, a margin of the seeds'
spread (compare-replay's rule), "failed" as a majority of collapsed seeds (last 3-step window
more than 0.1 below the best)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_replay_long.py"
STEPS = 8
STEADY = [0.6] * STEPS
RISING = [0.5, 0.5, 0.6, 0.6, 0.7, 0.7, 0.8, 0.8]
FALLING = [0.7, 0.7, 0.6, 0.6, 0.4, 0.4, 0.3, 0.3]  # last window 0.3 < best 0.7 - 0.1: collapsed


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("compare_replay_long_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write(out: Path, part: str, name: str, rewards: list[float], seeds: int = 2, done: bool = True) -> None:
    for seed in range(seeds):
        run = out / part / "runs" / f"{name}-s{seed}"
        run.mkdir(parents=True)
        rows = [
            {"step": s, "reward/mean": r + 0.005 * seed, "train/mismatch_k3_kl": 1e-3}
            for s, r in enumerate(rewards, start=1)
        ]
        rows[-1]["eval/heldout/pass@1"] = 0.3 + 0.1 * seed
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        if done:
            (run / "DONE").write_text("{}\n")


def test_the_four_findings_as_the_paper_reports_them_are_reproduced(bench, tmp_path):
    write(tmp_path, "k1", "grpo-k1-none", RISING)
    write(tmp_path, "k1-no-is", "grpo-k1-none", FALLING)
    for algo in ("grpo", "gspo"):
        for k, (none, r2, r3) in {
            2: (STEADY, RISING, STEADY),
            4: (FALLING, FALLING, RISING),
            8: (FALLING, FALLING, RISING),
        }.items():
            write(tmp_path, f"k{k}", f"{algo}-k{k}-none", none if algo == "grpo" else STEADY)
            write(tmp_path, f"k{k}", f"{algo}-k{k}-r2", r2)
            write(tmp_path, f"k{k}", f"{algo}-k{k}-r3", r3)
    found = bench.verdicts(bench.read_cells(tmp_path, STEPS))
    assert {key: verdict for key, (verdict, _) in found.items()} == dict.fromkeys("abcd", "reproduced")
    assert "token TIS: reward 0.769 ± 0.004, collapsed 0 of 2" in found["a"][1]
    assert "no correction: reward 0.336 ± 0.004, collapsed 2 of 2" in found["a"][1]


def test_noise_one_seed_and_the_opposite_result_are_told_apart(bench, tmp_path):
    write(tmp_path, "k1", "grpo-k1-none", STEADY)
    write(tmp_path, "k1-no-is", "grpo-k1-none", [0.61] * STEPS)  # within the margin
    write(tmp_path, "k2", "grpo-k2-none", RISING)  # R2 is beaten: the opposite
    write(tmp_path, "k2", "grpo-k2-r2", STEADY)
    write(tmp_path, "k2", "grpo-k2-r3", STEADY)
    for k, r2 in ((4, FALLING), (8, STEADY)):  # one seed each: neither a failure nor a hold is said
        for mode, rewards in (("none", STEADY), ("r2", r2), ("r3", RISING)):
            write(tmp_path, f"k{k}", f"grpo-k{k}-{mode}", rewards, seeds=1)
    write(tmp_path, "k8", "gspo-k8-none", RISING, done=False)  # unfinished runs are not read
    found = bench.verdicts(bench.read_cells(tmp_path, STEPS))
    assert found["a"][0] == "inconclusive"
    assert found["b"][0] == "not reproduced"
    assert found["c"][0] == "inconclusive"
    assert found["d"][0] == "inconclusive"  # GRPO without replay never failed
    assert "GSPO: reward –, collapsed 0 of 0" in found["d"][1]
