"""`megatron-rlvr train` end to end, every component real: CPU engine servers, the Megatron
learner, the rollout manager, verifier sandbox, buffer, weight sync with parity probe."""

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def train(tmp_path, *overrides):
    command = [sys.executable, "-m", "megatron_rlvr.cli", "train", str(REPO / "configs" / "tiny-moe-cpu.yaml"),
               f"trainer.output_dir={tmp_path}", "trainer.steps=3", "buffer.batch_groups=4",
               "rollout.n_samples_per_prompt=4", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()], done


@pytest.mark.parametrize("replay", ["none", "r3"])
def test_a_short_run_trains_syncs_and_logs(replay, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    metrics, done = train(tmp_path, f"algo.routing_replay={replay}")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert {"reward/mean", "buffer/kept_groups", "buffer/dropped_zero_std", "time/step_s"} <= set(m)
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["reward/samples"] > 0
        assert m["weight_sync/parity_max_gap"] <= 1e-5 and m["weight_sync/version"] == m["step"]
        assert m["train/grad_norm"] > 0 and m["buffer/used"] == 4 * m["step"]
        if replay == "r3":
            assert 0.0 < m["train/routing_agreement_engine"] <= 1.0
    assert "3/3" in done.stderr and "reward=" in done.stderr  # the progress bar
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoint" / "metadata.json").exists()
    assert (tmp_path / "model" / "tokenizer.json").exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # nothing left running


def test_a_layout_local_mode_cannot_run_is_one_line_not_a_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megatron_rlvr.cli", "train", str(REPO / "configs" / "tiny-moe-cpu.yaml"),
                           f"trainer.output_dir={tmp_path}", "parallel.ep=2"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "local runs train with one learner rank" in done.stderr.strip().splitlines()[-1]


def test_sigterm_mid_run_stops_every_engine(tmp_path):
    import os
    import signal
    import time

    command = [sys.executable, "-m", "megatron_rlvr.cli", "train", str(REPO / "configs" / "tiny-moe-cpu.yaml"),
               f"trainer.output_dir={tmp_path}", "trainer.steps=500"]
    log = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 300
    while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    engines = [p for p in psutil.Process(proc.pid).children(recursive=True) if "rollout.server" in " ".join(p.cmdline())]
    assert engines
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(120) == 130
    log.close()
    assert "interrupted; every component was stopped" in (tmp_path / "stderr.log").read_text()
    gone, alive = psutil.wait_procs(engines, timeout=30)
    assert not alive
