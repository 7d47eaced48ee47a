"""The long-answer demo end to end: `megatron-rlvr sft` makes the cold start, `megatron-rlvr
train` starts from its export (the first weight sync's parity probe passes), and GRPO raises
held-out pass@1 by the goal the docs state. The chain is slow (a minute or two), the demo
itself slower; a two-step `sft` and the goal's check on recorded numbers run in the default tier."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SFT = REPO / "configs" / "long-answers-sft-cpu.yaml"
RL = REPO / "configs" / "long-answers-cpu.yaml"


def command(name: str, config: Path, *overrides: str, timeout_s: int) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", name, str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir="))
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_the_sft_command_trains_evaluates_and_exports(tmp_path):
    """The README's cold-start command, cut to 2 small steps (default tier: a signature change
    once broke every `megatron-rlvr sft` run while only slow tests ran the command), with the
    model's shape overridden as the 8-expert cold start of compare-replay-long-cpu.yaml is
    (an override of the trained model once broke the scoring of its export)."""
    sft = command(
        "sft",
        SFT,
        f"trainer.output_dir={tmp_path}",
        "model.num_experts=8",
        "trainer.steps=2",
        "trainer.warmup_steps=1",
        "sft.batch_tokens=2048",
        "eval.max_prompts=1",
        timeout_s=600,
    )
    assert sft[0]["step"] == 0 and [m["step"] for m in sft if "train/sft_loss" in m] == [1, 2]
    final = {k: v for m in sft if m["step"] == 2 for k, v in m.items()}
    assert final["heldout/sft_loss"] < sft[0]["heldout/sft_loss"]  # it learned
    assert final["eval/heldout/prompts"] == 1 and final["eval/heldout/failed"] == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_local_experts"] == 8
    assert list((tmp_path / "hf").glob("*.safetensors"))


@pytest.mark.slow
def test_the_cold_start_is_what_an_rl_run_trains_and_its_engines_serve(tmp_path):
    sft = command(
        "sft",
        SFT,
        f"trainer.output_dir={tmp_path / 'sft'}",
        "trainer.steps=3",
        "trainer.warmup_steps=1",
        "eval.max_prompts=4",
        timeout_s=600,
    )
    assert sft[0]["step"] == 0 and "heldout/sft_loss" in sft[0]
    assert sft[-1]["step"] == 3 and "eval/heldout/pass@1" in sft[-1]
    rl = command(
        "train",
        RL,
        f"trainer.output_dir={tmp_path / 'rl'}",
        f"model.path={tmp_path / 'sft' / 'hf'}",
        "trainer.steps=2",
        "eval.max_prompts=4",
        timeout_s=600,
    )
    steps = [m for m in rl if "train/grad_norm" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["weight_sync/parity_max_gap"] <= 1e-3 for m in steps)  # the export reached the engine
    assert all(0 < m["response_length/p50"] <= m["response_length/p95"] <= m["response_length/max"] for m in steps)
    # the RL run's step-0 evaluation scores the same model on the same problems as the cold start's last
    assert rl[0]["eval/heldout/pass@1"] == pytest.approx(sft[-1]["eval/heldout/pass@1"])


GOAL = 0.3  # the demo's goal (README, docs/long-answers.md): held-out pass@1 over the cold start's


def goal_shortfall(rl: list[dict], goal: float = GOAL) -> str | None:
    """None when the RL run's held-out pass@1 at its last step is at least `goal` above its
    step-0 evaluation (the cold start's score), else what it measured instead."""
    evals = [m for m in rl if "eval/heldout/pass@1" in m]
    if not evals or evals[0]["step"] != 0 or evals[-1]["step"] != rl[-1]["step"]:
        return f"no held-out evaluation at step 0 and at the last step (evaluated at {[m['step'] for m in evals]})"
    start, end = evals[0]["eval/heldout/pass@1"], evals[-1]["eval/heldout/pass@1"]
    if end - start >= goal - 1e-9:  # pass@1 is a count over 256 samples: no rounding to speak of
        return None
    return (
        f"held-out pass@1 {start:.3f} -> {end:.3f} by step {evals[-1]['step']}: {end - start:+.3f}, the goal {goal:+}"
    )


def evaluations(*points: tuple[int, float]) -> list[dict]:
    return [{"step": step, "eval/heldout/pass@1": value} for step, value in points]


def test_the_demo_goal_check_holds_the_measured_run_and_refuses_a_miss():
    """The slow demo test's check, on what docs/long-answers.md records: seed 3 met the goal
    (0.188 -> 0.559); the earlier cold start's run missed it by a hair (0.117 -> 0.410)."""
    seed3 = evaluations((0, 0.188), (10, 0.363), (20, 0.453), (30, 0.480), (40, 0.523), (50, 0.543), (60, 0.559))
    assert goal_shortfall(seed3) is None
    assert goal_shortfall(seed3, goal=0.4) == "held-out pass@1 0.188 -> 0.559 by step 60: +0.371, the goal +0.4"
    assert goal_shortfall(evaluations((0, 0.117), (60, 0.410))) == (
        "held-out pass@1 0.117 -> 0.410 by step 60: +0.293, the goal +0.3"
    )
    assert goal_shortfall([*seed3[:-1], {"step": 60}]) is not None  # no evaluation at the end: not met


@pytest.mark.slow
def test_grpo_raises_heldout_pass_at_1_over_the_cold_start(tmp_path):
    """The demo as the README gives it (about 2.5 + 14 minutes alone on 2 cores): on the
    odd-count problem, whose held-out problems a model gets right only by the rule, GRPO
    raises held-out pass@1 by GOAL over the cold start."""
    sft = command("sft", SFT, f"trainer.output_dir={tmp_path / 'sft'}", timeout_s=900)
    rl = command(
        "train", RL, f"trainer.output_dir={tmp_path / 'rl'}", f"model.path={tmp_path / 'sft' / 'hf'}", timeout_s=2400
    )
    start = rl[0]["eval/heldout/pass@1"]
    assert start == pytest.approx(sft[-1]["eval/heldout/pass@1"])  # step 0 scores the cold start
    assert 0.1 <= start <= 0.6
    shortfall = goal_shortfall(rl)
    assert shortfall is None, shortfall


@pytest.mark.slow
def test_a_stopped_sft_run_resumes_to_the_same_losses(tmp_path):
    """SIGINT after a finished step saves it; trainer.resume=true continues with the same
    batches and optimizer state, so every later step's loss is the uninterrupted run's."""
    import signal
    import time

    base = ["trainer.steps=6", "sft.pass_at_1=false", "sft.eval_interval=0"]
    whole = command("sft", SFT, f"trainer.output_dir={tmp_path / 'whole'}", *base, timeout_s=600)
    out = tmp_path / "stopped"
    argv = [sys.executable, "-m", "megatron_rlvr.cli", "sft", str(SFT), f"trainer.output_dir={out}", *base]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while '"step": 2' not in ((out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "continue with trainer.resume=true" in stderr, stderr[-2000:]
    resumed = command("sft", SFT, f"trainer.output_dir={out}", *base, "trainer.resume=true", timeout_s=600)
    loss = {m["step"]: m["train/sft_loss"] for m in whole if "train/sft_loss" in m}
    again = {m["step"]: m["train/sft_loss"] for m in resumed if "train/sft_loss" in m}
    assert sorted(again) == sorted(loss)  # every step once
    assert all(again[s] == pytest.approx(loss[s], rel=1e-5) for s in loss)
