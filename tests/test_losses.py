"""Policy losses against hand-worked numbers, independent closed forms and gradcheck."""

import math

import pytest
import torch

from megatron_rlvr.algo.corrections import RolloutCorrection
from megatron_rlvr.algo.losses import policy_loss

CLIP = dict(clip_low=0.2, clip_high=0.28)
TIS2 = RolloutCorrection(is_level="token", is_upper=2.0)  # the default config's correction


def _ratios_batch(ratios, advantages):
    """old = 0, logprobs = log(ratio): ratios are exact."""
    logprobs = torch.tensor(ratios, dtype=torch.float64).log().requires_grad_(True)
    old = torch.zeros_like(logprobs)
    return logprobs, old, torch.tensor(advantages, dtype=torch.float64)


def test_grpo_hand_worked_clip_higher():
    logprobs, old, adv = _ratios_batch([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]], [1.0, -1.0])
    mask = torch.ones(2, 3)
    loss, m = policy_loss(logprobs, old, adv, mask, kind="grpo", **CLIP)
    # A=+1: -min(r, clip r) = -0.5, -1, -1.28 ; A=-1: max(r, clip r) = 0.8, 1, 1.5
    per_token = torch.tensor([[-0.5, -1.0, -1.28], [0.8, 1.0, 1.5]], dtype=torch.float64)
    assert loss.item() == pytest.approx(per_token.mean().item())
    assert m["clipfrac"].item() == pytest.approx(2 / 6)
    assert m["clipfrac_low_side"].item() == pytest.approx(1 / 6)
    assert m["clipfrac_high_side"].item() == pytest.approx(1 / 6)
    assert m["clipfrac_lower"].item() == 0.0
    loss.backward()
    # d/dlogp of -A·r = -A·r where the clip is inactive, 0 where it is active
    expected = torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]], dtype=torch.float64) / 6
    torch.testing.assert_close(logprobs.grad, expected)


def test_grpo_dual_clip_caps_negative_advantages_only():
    logprobs, old, adv = _ratios_batch([[5.0, 1.0], [5.0, 1.0]], [-1.0, 1.0])
    loss, m = policy_loss(logprobs, old, adv, torch.ones(2, 2), kind="grpo", clip_ratio_c=3.0, **CLIP)
    # A=-1, r=5: PPO gives max(5, 1.28) = 5, dual clip caps at -A·c = 3; A=+1 untouched
    per_token = torch.tensor([[3.0, 1.0], [-1.28, -1.0]])
    assert loss.item() == pytest.approx(per_token.mean().item())
    assert m["clipfrac_lower"].item() == pytest.approx(1 / 4)
    loss.backward()
    assert logprobs.grad[0, 0].item() == 0.0  # dual-clipped token pushes no gradient
    assert logprobs.grad[0, 1].item() == pytest.approx(1.0 / 4)


def test_grpo_log_ratio_is_clamped():
    logprobs = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-100.0, 0.0]], dtype=torch.float64)
    loss, m = policy_loss(logprobs, old, torch.tensor([-1.0]), torch.ones(1, 2), kind="grpo", **CLIP)
    assert torch.isfinite(loss)
    assert m["ratio_max"].item() == pytest.approx(math.exp(20.0))


def test_gspo_sequence_ratio_value_and_gradient_match_the_paper():
    torch.manual_seed(0)
    logprobs = (torch.randn(3, 5, dtype=torch.float64) * 0.01 - 1.0).requires_grad_(True)
    old = logprobs.detach() + torch.randn(3, 5, dtype=torch.float64) * 1e-4
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    loss, m = policy_loss(
        logprobs, old, adv, mask, kind="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"
    )
    # GSPO: J = mean_i A_i · s_i with s_i = exp(mean_t (logπ − logπ_old)) (no clip active here)
    lp = logprobs.detach().clone().requires_grad_(True)
    seq_ratio = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    assert m["clipfrac"].item() == 0.0
    reference = -(adv * seq_ratio).mean()
    reference.backward()
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    torch.testing.assert_close(logprobs.grad, lp.grad)


def test_gspo_clips_whole_sequences():
    # sequence 0: mean log-ratio 0.01 → s = 1.01 > 1 + 4e-4 : clipped for A > 0 (no gradient)
    logprobs = torch.tensor([[0.02, 0.0], [1e-4, -1e-4]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=torch.float64)
    loss, m = policy_loss(
        logprobs, old, torch.tensor([1.0, 1.0]), torch.ones(2, 2), kind="gspo", clip_low=3e-4, clip_high=4e-4
    )
    assert m["clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    assert torch.equal(logprobs.grad[0], torch.zeros(2, dtype=torch.float64))
    assert (logprobs.grad[1] != 0).all()
    expected = (-(1 + 4e-4) * 2 - 1.0 * 2) / 4
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_each_token_by_capped_ratio(level):
    logprobs, old, adv = _ratios_batch([[1.0, 1.0, 1.0]], [1.0])
    rollout = torch.tensor([[0.0, math.log(2.0), -math.log(3.0)]], dtype=torch.float64)
    # π_old/π_rollout per token: 1, 0.5, 3 (capped to 2); sequence: 1.5 (under the cap)
    loss, m = policy_loss(
        logprobs,
        old,
        adv,
        torch.ones(1, 3),
        kind="grpo",
        rollout_logprobs=rollout,
        correction=RolloutCorrection(is_level=level, is_upper=2.0),
        **CLIP,
    )
    weights = [1.0, 0.5, 2.0] if level == "token" else [1.5, 1.5, 1.5]
    assert loss.item() == pytest.approx(-sum(weights) / 3)
    assert m["rollout_is_mean"].item() == pytest.approx(sum(weights) / 3)
    assert "mismatch_abs_max" in m and m["mismatch_abs_max"].item() == pytest.approx(math.log(3.0))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -torch.tensor([weights], dtype=torch.float64) / 3)


def test_no_weights_without_a_correction():
    logprobs, old, adv = _ratios_batch([[1.0, 1.0]], [1.0])
    rollout = torch.full((1, 2), -5.0, dtype=torch.float64)
    loss, m = policy_loss(logprobs, old, adv, torch.ones(1, 2), kind="grpo", rollout_logprobs=rollout, **CLIP)
    assert loss.item() == pytest.approx(-1.0)
    assert "rollout_is_mean" not in m and m["mismatch_abs_mean"].item() == pytest.approx(5.0)


def _unit_loss_batch():
    """Per-token loss −A·r with r = 1: aggregation is all that differs."""
    logprobs = torch.zeros(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    return logprobs, mask, adv


@pytest.mark.parametrize(
    "agg, normalizer, expected",
    [
        ("token-mean", None, -(4 * 1 + 2 * 2 + 1 * 3) / 7),
        ("token-mean", 14.0, -(4 * 1 + 2 * 2 + 1 * 3) / 14),
        ("seq-mean-token-mean", None, -(1 + 2 + 3) / 3),
        ("seq-mean-token-mean", 6.0, -(1 + 2 + 3) / 6),
        ("seq-mean-token-sum-norm", None, -((4 * 1 + 2 * 2 + 1 * 3) / 4) / 3),
        ("seq-mean-token-sum-norm", 8.0, -((4 * 1 + 2 * 2 + 1 * 3) / 8) / 3),
    ],
)
def test_aggregation_modes(agg, normalizer, expected):
    logprobs, mask, adv = _unit_loss_batch()
    loss, _ = policy_loss(logprobs, logprobs, adv, mask, kind="grpo", agg=agg, agg_normalizer=normalizer, **CLIP)
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_global_normalizer_makes_micro_batches_sum_to_the_full_batch(kind, agg):
    """The classic silent bug: normalising per micro-batch. With the global count passed
    in, summed micro-batch losses and gradients equal the full batch's exactly."""
    torch.manual_seed(1)
    logprobs = (torch.randn(6, 7, dtype=torch.float64) * 0.1 - 2).requires_grad_(True)
    old = logprobs.detach() + torch.randn(6, 7, dtype=torch.float64) * 0.05
    mask = (torch.rand(6, 7) > 0.3).double()
    mask[:, 0] = 1
    adv = torch.randn(6, dtype=torch.float64)
    clip = CLIP if kind == "grpo" else dict(clip_low=0.01, clip_high=0.01)
    full, _ = policy_loss(logprobs, old, adv, mask, kind=kind, agg=agg, **clip)
    (full_grad,) = torch.autograd.grad(full, logprobs)
    normalizer = mask.sum() if agg == "token-mean" else float(mask.shape[0])
    total = sum(
        policy_loss(logprobs[s], old[s], adv[s], mask[s], kind=kind, agg=agg, agg_normalizer=normalizer, **clip)[0]
        for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    (split_grad,) = torch.autograd.grad(total, logprobs)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(split_grad, full_grad)
    naive = (
        sum(
            policy_loss(logprobs[s], old[s], adv[s], mask[s], kind=kind, agg=agg, **clip)[0]
            for s in (slice(0, 2), slice(2, 3), slice(3, 6))
        )
        / 3
    )
    assert naive.item() != pytest.approx(full.item(), rel=1e-6)  # the bug this guards against


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_fully_masked_rows_and_garbage_padding_do_not_leak(kind, agg):
    torch.manual_seed(2)
    logprobs = (torch.randn(3, 4, dtype=torch.float64) * 0.01 - 1).requires_grad_(True)
    old = logprobs.detach() + 1e-5
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, 5.0, -1.0], dtype=torch.float64)
    rollout = old.clone()
    clean, _ = policy_loss(
        logprobs, old, adv, mask, kind=kind, agg=agg, rollout_logprobs=rollout, correction=TIS2, **CLIP
    )
    (clean_grad,) = torch.autograd.grad(clean, logprobs)
    dirty_old, dirty_rollout = old.clone(), rollout.clone()
    dirty_old[mask == 0] = float("inf")
    dirty_rollout[mask == 0] = float("nan")
    dirty, m = policy_loss(
        logprobs, dirty_old, adv, mask, kind=kind, agg=agg, rollout_logprobs=dirty_rollout, correction=TIS2, **CLIP
    )
    (dirty_grad,) = torch.autograd.grad(dirty, logprobs)
    assert torch.isfinite(dirty) and all(torch.isfinite(v).all() for v in m.values())
    assert dirty.item() == pytest.approx(clean.item(), rel=1e-12)
    torch.testing.assert_close(dirty_grad, clean_grad)
    assert torch.equal(dirty_grad[1], torch.zeros(4, dtype=torch.float64))


def test_all_masked_batch_is_zero_with_zero_grad():
    logprobs = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(logprobs, logprobs.detach(), torch.ones(2), torch.zeros(2, 3), kind="grpo", **CLIP)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logprobs.grad, torch.zeros(2, 3, dtype=torch.float64))
    assert m["clipfrac"].item() == 0.0


def test_token_level_advantages_accepted():
    logprobs, old, _ = _ratios_batch([[1.0, 1.0]], [0.0])
    loss, _ = policy_loss(
        logprobs, old, torch.tensor([[1.0, 3.0]], dtype=torch.float64), torch.ones(1, 2), kind="grpo", **CLIP
    )
    assert loss.item() == pytest.approx(-2.0)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("grpo", {}),
        ("grpo", {"clip_ratio_c": 3.0}),
        ("grpo", {"correction": RolloutCorrection(is_upper=1.5), "agg": "seq-mean-token-mean"}),
        ("gspo", {"agg": "seq-mean-token-mean"}),
        (
            "gspo",
            {"correction": RolloutCorrection(is_level="sequence", is_upper=1.5), "agg": "seq-mean-token-sum-norm"},
        ),
    ],
)
def test_gradcheck_float64(kind, extra):
    torch.manual_seed(3)
    old = torch.randn(4, 6, dtype=torch.float64) - 2
    # ratios well inside or well outside the clip range: away from the kinks of max/clamp
    offsets = torch.tensor([0.0, 0.05, 0.5, -0.6, 0.01, -0.02], dtype=torch.float64) * (1.0 if kind == "grpo" else 0.01)
    logprobs = (old + offsets).requires_grad_(True)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 4:] = 0
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    rollout = old + 0.1 * torch.randn(4, 6, dtype=torch.float64)
    clip = CLIP if kind == "grpo" else dict(clip_low=3e-4, clip_high=4e-4)
    tis = {"rollout_logprobs": rollout} if "correction" in extra else {}

    def fn(lp):
        return policy_loss(lp, old, adv, mask, kind=kind, **clip, **tis, **extra)[0]

    assert torch.autograd.gradcheck(fn, (logprobs,), eps=1e-7, atol=1e-6)


def test_bad_arguments_name_what_is_wrong():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="kind='ppo'"):
        policy_loss(x, x, torch.zeros(2), x, kind="ppo", **CLIP)
    with pytest.raises(ValueError, match="agg='mean'"):
        policy_loss(x, x, torch.zeros(2), x, kind="grpo", agg="mean", **CLIP)
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(x, x, torch.zeros(2), torch.zeros(2, 4), kind="grpo", **CLIP)
