"""Colocated runs against real SGLang 0.5.23 on CPU (.venv-sglang): the engine releases and
resumes its memory every step, the weights reach it through update_weights_from_tensor (no
update group), the parity probe passes after every hand-over, and the run learns as the
separate-device run does."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from engine_fixtures import REPO, sglang_python

pytestmark = pytest.mark.sglang


def train(out: Path, steps: int, *overrides: str) -> list[dict]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "train",
            str(REPO / "configs" / "tiny-moe-sglang-cpu.yaml"),
            f"trainer.output_dir={out}",
            f"rollout.engine.python={sglang_python()}",
            f"trainer.steps={steps}",
            "trainer.save_interval=0",
            "buffer.batch_groups=4",
            "rollout.n_samples_per_prompt=4",
            "launch.mode=local",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def engine_requests(out: Path, path: str) -> int:
    return sum(log.read_text().count(f'"POST {path} HTTP/1.1" 200') for log in (out / "logs").glob("engine-*.log"))


def test_a_colocated_run_hands_sglang_its_weights_in_memory_and_passes_the_probe_every_step(tmp_path):
    out = tmp_path / "run"
    metrics = train(out, 3, "launch.colocation.enabled=true")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["weight_sync/engine_version"] == m["policy_version"] == m["step"]
        assert m["weight_sync/parity_max_gap"] <= m["weight_sync/parity_tolerance"] == 1e-3
        assert m["colocate/handover_bytes"] == m["weight_sync/bytes"] > 0
        assert m["colocate/sleep_s"] > 0 and m["colocate/wake_s"] > 0 and m["colocate/handover_s"] > 0
    # every step: KV cache then weights released, weights then KV cache resumed, one bucket handed over
    assert engine_requests(out, "/release_memory_occupation") == 2 * 3
    assert engine_requests(out, "/resume_memory_occupation") == 2 * 3
    assert engine_requests(out, "/update_weights_from_tensor") == 3
    assert engine_requests(out, "/init_weights_update_group") == 0  # no broadcast path


@pytest.mark.slow  # two SGLang runs of 8 steps: ~6 min on 2 cores
def test_a_colocated_run_learns_as_the_separate_run_does(tmp_path):
    """SGLang on CPU samples unseeded, so the two runs draw different samples from the start and
    their rewards differ by sampling noise. Each step's mean reward is a mean of 0/1 rewards
    over reward/samples samples, so two runs of the same policy differ by a standard error of
    sqrt(p(1-p)(1/n_a + 1/n_b)) with p the pooled mean; a step more than 4 such errors apart
    (chance < 1e-4 a step under the same policy) is a colocated run that learns differently.
    Both runs must also learn: the last three steps' reward above the first's."""
    steps = 8
    separate = train(tmp_path / "separate", steps)
    colocated = train(tmp_path / "colocated", steps, "launch.colocation.enabled=true")
    compared = 0
    for a, b in zip(separate, colocated):
        assert b["weight_sync/parity_max_gap"] <= 1e-3
        if "reward/mean" not in a or "reward/mean" not in b:  # a step trained from the buffer's surplus
            continue
        na, nb = a["reward/samples"], b["reward/samples"]
        p = (a["reward/mean"] * na + b["reward/mean"] * nb) / (na + nb)
        bound = 4 * math.sqrt(max(p * (1 - p), 1e-4) * (1 / na + 1 / nb))
        assert abs(a["reward/mean"] - b["reward/mean"]) <= bound, (a["step"], a["reward/mean"], b["reward/mean"], bound)
        compared += 1
    assert compared >= steps // 2
    for run in (separate, colocated):
        rewards = [m["reward/mean"] for m in run if "reward/mean" in m]
        assert sum(rewards[-3:]) / 3 > rewards[0], rewards
