"""benchmarks/greso.py reads runs as the trainer writes them: metrics.jsonl rows with
cumulative buffer counters, steps without a reward (a batch from the buffer's surplus), and
evaluation lines every few steps; the table pairs each seed's runs off and on."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "greso.py"


@pytest.fixture(scope="module")
def greso():
    spec = importlib.util.spec_from_file_location("greso_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def rows(steps: int, generated_per_step: int, reward, skipped: int = 0) -> list[dict]:
    """metrics.jsonl lines of a run with batch_groups 4: counters cumulative, every 10th step
    trained from the surplus alone (no reward/mean), an evaluation at steps 0 mod 20."""
    out = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "buffer/generated": generated_per_step * step,
            "buffer/used": 4 * step,
            "sampler/skipped_prompts": skipped,
            "time/step_s": 0.5,
        }
        if step % 10:
            row["reward/mean"] = reward(step)
        if step % 20 == 0:
            row.update({"eval/arith/pass@1": 0.5, "eval/arith/avg@4": step / 100})
        out.append(row)
    return out


def test_a_run_is_summarised_from_its_last_counters_and_its_rewarded_steps(greso):
    result = greso.summarise("polarising", 0, True, rows(80, 12, lambda s: s / 80, skipped=2), wall_s=90.0)
    assert result.generated_per_used == pytest.approx(3.0)  # 960 generated for 320 trained on
    rewarded = [s for s in range(1, 81) if s % 10][-20:]  # the last 20 steps that have a reward
    assert result.last_reward == pytest.approx(sum(s / 80 for s in rewarded) / 20)
    # first step whose 10 latest rewards average 0.9 (gaps skipped, not counted as 0)
    assert result.step_to_target == 77
    assert result.skipped == 160 and result.eval_reward == pytest.approx(0.8)


def test_the_table_pairs_each_seed_off_and_on(greso):
    off = greso.summarise("polarising", 1, False, rows(40, 32, lambda s: 0.6), wall_s=80.0)
    on = greso.summarise("polarising", 1, True, rows(40, 16, lambda s: 0.6, skipped=3), wall_s=60.0)
    never = greso.summarise("default", 0, False, rows(30, 8, lambda s: 0.5), wall_s=10.0)
    lines = greso.table([off, on, never]).splitlines()
    assert lines[0].split()[:5] == ["run", "seed", "skip", "steps", "gen/used"]
    assert lines[2].split()[:5] == ["polarising", "1", "off", "40", "8.00"]
    assert lines[3].split()[:5] == ["polarising", "1", "on", "40", "4.00"]
    assert lines[4].split()[7] == "-"  # never reached 0.9
    assert lines[-1] == (
        "ratio polarising seed 1: generated per used off/on 2.00x, wall off/on 1.33x, last-20 reward 0.600 -> 0.600"
    )  # the default run has no pair here
