"""A short real run with the off-policy settings wired end to end: bypass mode (the engine's
logprobs are the old ones, no old-logprob pass), REINFORCE with truncated IS weights, a
rejection rule, and a non-default baseline with reward shaping."""

from __future__ import annotations

import math

import pytest
from test_train_e2e import train


@pytest.mark.slow  # a real run: ~90 s on 2 cores
def test_bypass_reinforce_with_rejection_and_rloo_runs_and_reports(tmp_path):
    metrics, _ = train(
        tmp_path,
        "launch.mode=local",
        "trainer.steps=2",
        "algo.rollout_correction.bypass_mode=true",
        "algo.rollout_correction.loss_type=reinforce",
        "algo.rollout_correction.rollout_rs=token_k3",
        "algo.rollout_correction.rollout_rs_threshold=0.5",
        "algo.advantage.baseline_type=rloo",
        "algo.advantage.reward_clip=1.0",
    )
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["train/policy_loss"]) and m["train/grad_norm"] > 0
        assert 0.0 <= m["train/rollout_rs_masked_fraction"] <= 1.0 and m["train/rollout_is_mean"] > 0
        # old logprobs are the engine's: the PPO-side KL is the train/engine mismatch itself
        assert m["train/approx_kl"] == pytest.approx(m["train/mismatch_k3_kl"], rel=1e-6, abs=1e-9)
