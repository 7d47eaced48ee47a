"""benchmarks/off_policy.py reads a cell's runs as compare-replay leaves them: finished runs only
(a DONE marker), steps without a reward (a batch from the buffer's surplus), held-out pass@1
on the last line, and the report's collapse rule."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "off_policy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("off_policy_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write_run(folder: Path, name: str, rewards: list[float | None], pass1: float, done: bool = True) -> None:
    run = folder / "runs" / name
    run.mkdir(parents=True)
    rows = [
        {
            "step": step,
            "train/mismatch_k3_kl": 1e-3,
            "train/rollout_is_clipfrac": 0.01,
            **({"reward/mean": r} if r is not None else {}),
        }
        for step, r in enumerate(rewards, start=1)
    ]
    rows[-1]["eval/heldout/pass@1"] = pass1
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if done:
        (run / "DONE").write_text("{}\n")


def test_a_cell_counts_finished_seeds_and_collapses(bench, tmp_path):
    steady = [0.6, 0.6, None, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
    write_run(tmp_path, "grpo-k4-none-s0", steady, 0.4)
    write_run(tmp_path, "grpo-k4-none-s1", [0.6, 0.8, 0.8, 0.6, 0.6, 0.5, 0.5, 0.4, 0.3, 0.3], 0.2)
    write_run(tmp_path, "grpo-k4-none-s2", steady, 0.9, done=False)  # stopped: not counted
    seeds, pass1, reward, collapsed, kl, corrected = bench.cell_row(tmp_path, steps=10)
    assert seeds == 2 and collapsed == "1 of 2"  # s1's last 3-step window 0.33 < its best 0.73 - 0.1
    assert pass1 == "0.300 ± 0.141"
    assert reward == "0.667 ± 0.094 → 0.467 ± 0.189" and kl == "1.0e-03" and corrected == "1.00%"


def test_an_empty_cell_prints_dashes(bench, tmp_path):
    assert bench.cell_row(tmp_path, steps=10) == (0, "–", "–", "–", "–", "–")
