"""The post-sync parity probe: what it judges (the max gap with the engine's routing replayed,
the median without), and a failed probe ending a run only once the step it follows is saved,
with a message that says how to go on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rlvr import run_dir
from megatron_rlvr.weight_sync.probe import ParityError, check_parity

REPO = Path(__file__).resolve().parents[1]
A, B = "http://a:1", "http://b:2"


def test_a_routing_flip_fails_the_probe_only_where_the_engines_routing_was_replayed():
    """One token off by 0.4 (a flipped expert, or a real error on one token): with the engine's
    routing replayed nothing but numeric noise is left, so the max judges it; without, a flip
    is expected and the median judges (a broken sync moves every token)."""
    flip = {A: torch.tensor([0.01, 0.02, 0.4, 0.01, 0.0, 0.03, 0.01, 0.02]), B: torch.zeros(8)}
    metrics = check_parity(flip, 0.1, replayed=False, metrics={"weight_sync/version": 3})
    assert metrics["weight_sync/parity_max_gap"] == pytest.approx(0.4)
    assert metrics["weight_sync/parity_routing_replayed"] == 0.0 and metrics["weight_sync/version"] == 3
    with pytest.raises(ParityError) as err:
        check_parity(flip, 0.1, replayed=True, metrics={})
    assert f"engine {A} disagrees" in str(err.value) and "max |Δlogprob| over 8 probe tokens = 0.4" in str(err.value)
    assert err.value.metrics["weight_sync/parity_routing_replayed"] == 1.0


def test_a_broken_sync_fails_the_probe_either_way_and_says_how_to_go_on():
    broken = {A: torch.zeros(8), B: torch.full((8,), 3.0)}
    for replayed in (True, False):
        with pytest.raises(ParityError) as err:
            check_parity(broken, 0.5, replayed=replayed, metrics={"weight_sync/version": 2})
        message = str(err.value)
        assert f"engine {B} disagrees" in message and "\n" not in message
        assert "weight_sync.parity_tolerance" in message and "trainer.resume=true" in message
        assert err.value.metrics["weight_sync/version"] == 2  # the run logs the step's sync


def test_parity_error_crosses_processes_with_its_metrics():
    import pickle

    err = pickle.loads(pickle.dumps(ParityError("gap", {"weight_sync/parity_max_gap": 2.0})))
    assert str(err) == "gap" and err.metrics == {"weight_sync/parity_max_gap": 2.0}


def test_a_failed_probe_ends_the_run_after_the_step_is_logged_and_saved(tmp_path):
    """A tolerance nothing meets (1e-12 against a bf16 engine and an fp32 learner):
    the first step trains and syncs, its probe fails; the run logs step 1, saves it (between
    save intervals), and ends with one line saying where the checkpoint is and how to go on."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "train",
            str(REPO / "configs" / "tiny-moe-cpu.yaml"),
            f"trainer.output_dir={tmp_path}",
            "launch.mode=local",
            "trainer.steps=3",
            "trainer.save_interval=0",
            "buffer.batch_groups=4",
            "rollout.n_samples_per_prompt=4",
            "weight_sync.parity_tolerance=1e-12",
            "rollout.engine.dtype=bfloat16",  # fp32 engines can agree exactly on most tokens: a median gap of 0
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "disagrees with the learner after the weight sync" in last, last
    assert f"checkpoint of step 1 in {tmp_path / run_dir.CHECKPOINT}" in last and "trainer.resume=true" in last
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and metrics[0]["weight_sync/parity_max_gap"] > 1e-12
    found = run_dir.resumable(tmp_path / run_dir.CHECKPOINT)
    assert found is not None and found[1] == 1
