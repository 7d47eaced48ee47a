"""The rollout correction against verl 0.9.1 (fixtures its own functions wrote, see
tools/make_verl_fixtures.py) and against hand-worked cases: IS weights, rejection masks,
losses and gradients, float64, to 1e-6."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_rlvr.algo.corrections import RolloutCorrection, StaleNegativeCaps, rollout_correction, step_correction
from megatron_rlvr.algo.losses import policy_loss
from megatron_rlvr.config import load_config
from megatron_rlvr.config.rejection import parse_rejection

FIXTURES = torch.load(Path(__file__).parent / "data" / "verl_rollout_correction.pt", weights_only=True)
TOL = dict(atol=1e-6, rtol=1e-6)


def _threshold(spec) -> tuple[float, float | None]:
    """verl's rollout_is_threshold (upper, or "lower_upper") → our two fields."""
    if isinstance(spec, str) and "_" in spec:
        lower, upper = spec.split("_")
        return float(upper), float(lower)
    return float(spec), None


def _ours(case: dict) -> RolloutCorrection:
    upper, lower = _threshold(case.get("rollout_is_threshold", 2.0))
    return RolloutCorrection(
        is_level=case.get("rollout_is"),
        is_upper=upper,
        is_lower=lower,
        batch_normalize=case.get("rollout_is_batch_normalize", False),
        rejection=parse_rejection(case.get("rollout_rs"), case.get("rollout_rs_threshold")),
        bypass=case.get("bypass_mode", False),
        bypass_loss=case.get("loss_type", "ppo_clip"),
    )


@pytest.mark.parametrize("record", FIXTURES["records"], ids=lambda r: "-".join(str(v) for v in r["case"].values()))
def test_equal_to_verl(record):
    case, inputs, ref = record["case"], record["inputs"], record["verl"]
    corr = _ours(case)
    mask, adv = inputs["mask"], inputs["advantages"]
    if "keep" in ref:  # the correction itself (outside bypass mode verl exposes it)
        weights, keep, _ = rollout_correction(inputs["old_logprobs"], inputs["rollout_logprobs"], adv, mask, corr)
        torch.testing.assert_close(keep, ref["keep"], **TOL)
        if "is_weights" in ref:
            assert weights is not None
            torch.testing.assert_close(weights * mask, ref["is_weights"] * mask, **TOL)
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    clip = FIXTURES["clip"]
    loss, _ = policy_loss(
        logprobs,
        inputs["old_logprobs"],
        adv,
        mask,
        kind="gspo" if case["loss"] == "gspo" else "grpo",
        clip_low=clip["clip_ratio_low"],
        clip_high=clip["clip_ratio_high"],
        clip_ratio_c=None if case["loss"] == "gspo" else clip["clip_ratio_c"],
        agg=case["agg"],
        rollout_logprobs=inputs["rollout_logprobs"],
        correction=corr,
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(loss, ref["loss"], **TOL)
    torch.testing.assert_close(grad, ref["grad"], **TOL)


STEP_WIDE = [
    r
    for r in FIXTURES["records"]
    if not r["case"].get("bypass_mode")
    and r["case"]["agg"] in ("token-mean", "seq-mean-token-mean")
    and (r["case"].get("rollout_is_batch_normalize") or r["case"].get("rollout_rs"))
]


@pytest.mark.parametrize("record", STEP_WIDE, ids=lambda r: "-".join(str(v) for v in r["case"].values()))
def test_any_cut_into_micro_batches_gives_verls_whole_batch_loss(record):
    """Batch normalisation's mean and the rejected tokens are the whole batch's
    (step_correction), so the loss summed over uneven cuts of the rows, each divided by the
    step's count of kept tokens (or sequences), is verl's loss of the whole batch, and so is
    the gradient."""
    case, inputs, ref = record["case"], record["inputs"], record["verl"]
    corr = _ours(case)
    mask, adv = inputs["mask"], inputs["advantages"]
    step = step_correction(inputs["old_logprobs"], inputs["rollout_logprobs"], adv, mask, corr)
    assert step is not None and (step.batch_mean is not None) == corr.batch_normalize
    kept = mask * step.keep
    normalizer = kept.sum() if case["agg"] == "token-mean" else (kept.sum(-1) > 0).sum()
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    clip = FIXTURES["clip"]
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part, _ = policy_loss(
            logprobs[rows],
            inputs["old_logprobs"][rows],
            adv[rows],
            mask[rows],
            kind="grpo",
            clip_low=clip["clip_ratio_low"],
            clip_high=clip["clip_ratio_high"],
            clip_ratio_c=clip["clip_ratio_c"],
            agg=case["agg"],
            agg_normalizer=normalizer,
            rollout_logprobs=inputs["rollout_logprobs"][rows],
            correction=corr,
            correction_batch_mean=step.batch_mean,
        )
        total = total + part
    (grad,) = torch.autograd.grad(total, logprobs)
    torch.testing.assert_close(total, ref["loss"], **TOL)
    torch.testing.assert_close(grad, ref["grad"], **TOL)


def test_fixtures_exercise_what_they_claim():
    """Rejection and truncation actually bite in the recorded cases (else equality is cheap)."""
    rejected = [r for r in FIXTURES["records"] if "rollout_rs" in r["case"] and "keep" in r["verl"]]
    assert all(bool((r["verl"]["keep"] < r["inputs"]["mask"]).any()) for r in rejected)
    assert all(bool(r["verl"]["keep"].sum() > 0) for r in rejected)
    truncated = FIXTURES["records"][0]
    raw = torch.exp(truncated["inputs"]["old_logprobs"] - truncated["inputs"]["rollout_logprobs"])
    assert bool(((raw > 2.0) & truncated["inputs"]["mask"].bool()).any())


def _one_row(log_w: list[float], advantage: float = 1.0):
    rollout = torch.zeros(1, len(log_w), dtype=torch.float64)
    return torch.tensor([log_w], dtype=torch.float64), rollout, torch.tensor([[advantage]]), torch.ones_like(rollout)


def test_geometric_level_is_the_mean_log_ratio():
    old, rollout, adv, mask = _one_row([math.log(4.0), 0.0])
    weights, _, _ = rollout_correction(old, rollout, adv, mask, RolloutCorrection(is_level="geometric", is_upper=10.0))
    assert weights is not None
    torch.testing.assert_close(weights, torch.full((1, 2), 2.0, dtype=torch.float64))


def test_zero_lower_threshold_masks_only_above_the_cap_like_areal():
    old, rollout, adv, mask = _one_row([math.log(3.0), math.log(0.01), 0.0])
    weights, _, metrics = rollout_correction(old, rollout, adv, mask, RolloutCorrection(is_upper=2.0, is_lower=0.0))
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.01, 1.0]], dtype=torch.float64))
    assert metrics["rollout_is_clipfrac"].item() == pytest.approx(1 / 3)


def test_stale_negatives_bound_by_the_advantage_sign():
    log_w = [math.log(20.0), math.log(0.2), math.log(0.7), math.log(3.0)]
    old = torch.tensor([log_w, log_w], dtype=torch.float64)
    rollout, mask = torch.zeros_like(old), torch.ones_like(old)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    corr = RolloutCorrection(stale_negatives=StaleNegativeCaps())
    weights, _, metrics = rollout_correction(old, rollout, adv, mask, corr)
    assert weights is not None
    expected = torch.tensor([[10.0, 0.2, 0.7, 3.0], [1.0, 0.5, 0.7, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout_is_clipfrac_pos"].item() == pytest.approx(1 / 8)
    assert metrics["rollout_is_clipfrac_neg"].item() == pytest.approx(3 / 8)
    assert metrics["rollout_is_mean_neg"].item() == pytest.approx((1 + 0.5 + 0.7 + 1) / 4)


def test_decoupled_ppo_is_the_default_loss_with_the_proximal_old_logprobs():
    """AReaL: −min(r·A, clip(r)·A)·min(π_prox/μ, cap), r = π/π_prox, token-mean over the mask;
    with π_old = the learner's logprobs at the start of the step (π_prox), our grpo loss and
    a token-level TIS correction are exactly this."""
    torch.manual_seed(5)
    prox = -torch.rand(3, 5, dtype=torch.float64) * 2
    behaviour = prox + 0.4 * torch.randn(3, 5, dtype=torch.float64)
    logprobs = (prox + 0.3 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    mask[1, 3:] = 0
    ratio = torch.exp(logprobs - prox)
    areal = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)) * torch.exp(prox - behaviour).clamp(max=2.0)
    expected = (areal * mask).sum() / mask.sum()
    ours, _ = policy_loss(
        logprobs, prox, adv, mask, kind="grpo", clip_low=0.2, clip_high=0.28, rollout_logprobs=behaviour,
        correction=RolloutCorrection(is_level="token", is_upper=2.0),
    )  # fmt: skip
    torch.testing.assert_close(ours, expected, **TOL)
    torch.testing.assert_close(
        torch.autograd.grad(ours, logprobs)[0], torch.autograd.grad(expected, logprobs)[0], **TOL
    )


def test_rejection_drops_whole_sequences_and_counts_them():
    old = torch.tensor([[0.0, 0.0], [math.log(5.0), 0.0]], dtype=torch.float64)
    rollout, mask = torch.zeros_like(old), torch.ones_like(old)
    corr = RolloutCorrection(is_level=None, rejection=parse_rejection("seq_max_k2", 0.5))
    weights, keep, metrics = rollout_correction(old, rollout, torch.tensor([[1.0], [-1.0]]), mask, corr)
    assert weights is None
    torch.testing.assert_close(keep, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64))
    assert metrics["rollout_rs_seq_masked_fraction"].item() == 0.5
    assert metrics["rollout_rs_masked_fraction_neg"].item() == 0.5


@pytest.mark.parametrize(
    "options, thresholds, message",
    [
        ("token_k9", 1.0, "rollout_rs option 'token_k9'"),
        ("token_k2", "0.1_0.2", "a single upper bound"),
        ("token_k1", "2.0_1.5", "need 0 < lower <= upper"),
        ("token_k1,token_k2", "1,2,3", "give one, or one per option"),
        ("token_k2", None, "rollout_rs_threshold is not"),
    ],
)
def test_rejection_specs_are_refused_in_one_line(options, thresholds, message):
    with pytest.raises(ValueError, match=message):
        parse_rejection(options, thresholds)


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.rollout_correction.rollout_is_threshold=0", "algo.rollout_correction.rollout_is_threshold = 0"),
        ("algo.rollout_correction.rollout_is_threshold_lower=3", "algo.rollout_correction.rollout_is_threshold_lower"),
        ("algo.rollout_correction.rollout_rs=token_k4", "algo.rollout_correction.rollout_rs = 'token_k4'"),
        ("algo.stale_negatives.positive_cap=0.5", "algo.stale_negatives.positive_cap = 0.5"),
        ("algo.stale_negatives.negative_floor=2", "algo.stale_negatives.negative_floor = 2"),
        ("algo.rec.temp=0", "algo.rec.temp = 0"),
        ("algo.rec.clip_mode=both", "algo.rec.clip_mode"),
        ("algo.opmd.tau=-1", "algo.opmd.tau = -1"),
        ("algo.advantage.ema_decay=1", "algo.advantage.ema_decay = 1"),
        ("algo.advantage.reward_clip=0", "algo.advantage.reward_clip = 0"),
        ("algo.advantage.baseline_type=max", "algo.advantage.baseline_type"),
        ("algo.tis_level=token", "algo.tis_level: moved to algo.rollout_correction.rollout_is"),
        (
            "algo.stale_negatives.enabled=true algo.rollout_correction.bypass_mode=true",
            "algo.stale_negatives.enabled = true: bypass ppo_clip applies no weights",
        ),
        (
            "algo.kind=rec algo.rollout_correction.bypass_mode=true algo.rollout_correction.loss_type=reinforce",
            "algo.rollout_correction.loss_type = reinforce",
        ),
        (
            "algo.routing_replay=r2 algo.rollout_correction.bypass_mode=true",
            "algo.rollout_correction.bypass_mode = true: r2",
        ),
        ("algo.rollout_correction.rollout_rs_threshold=0.1", "algo.rollout_correction.rollout_rs_threshold = 0.1"),
    ],
)
def test_out_of_range_fields_are_refused_naming_the_key(override, message):
    from megatron_rlvr.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as err:
        load_config(Path(__file__).parents[1] / "configs" / "tiny-moe-cpu.yaml", override.split())
    assert "\n" not in str(err.value).strip()
