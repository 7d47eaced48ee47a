"""REC, OPMD, AsymRE and MiniRL against Trinity-RFT's formulas and hand-worked cases, on random
ragged float64 batches: values and gradients to 1e-6.

The references below are written from the published formulas, not from our code: REC from
Trinity-RFT's current rec_policy_loss.py (RECPolicyLossFn and its default_args: ε'_low 0.6,
ε'_high 2.0), OPMD and the aggregations from Trinity-RFT 0.6.0's opmd_policy_loss.py and
utils.aggregate_loss."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_rlvr.algo.from_config import loss_options
from megatron_rlvr.algo.losses import policy_loss
from megatron_rlvr.algo.reinforce import REC_CLIP_MODES, REC_REGULARIZERS, REC_WEIGHTS, RecOptions
from megatron_rlvr.config import ConfigError, load_config

TOL = dict(atol=1e-6, rtol=1e-6)
EPS_LOW, EPS_HIGH = 0.2, 0.25
# ε' bounds the truncated weight to [0.7, 1.4]: the test batch has ratios on both sides of it
EPS_LOW_PRIME, EPS_HIGH_PRIME = 0.3, 0.4


def _batch(seed: int, rows: int = 5, width: int = 7):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2 - 0.1
    logprobs = (old + 0.3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)).requires_grad_(True)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64)
    adv[0] = 0.0  # the A = 0 edge of the one-sided modes
    return logprobs, old, adv.expand(rows, width), mask


def _trinity_mean(values, mask, dim=None):
    return (values * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)


def _trinity_rec(logprob, old, mask, adv, loss_agg_mode, o: RecOptions):
    """Trinity's RECPolicyLossFn.__call__, restated: keep-mask, weight, regulariser, then its
    aggregation, which is seq-mean-token-mean under gspo-one-side whatever loss_agg_mode says."""
    ratio = torch.exp(logprob - old).detach()
    seq_ratio = torch.exp(_trinity_mean(logprob - old, mask, dim=-1)).detach().unsqueeze(-1)
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    mode = o.clip_mode
    if mode == "two-side":
        keep = (ratio >= lo) * (ratio <= hi)
    elif mode == "one-side":
        keep = (ratio <= hi) * (adv >= 0) + (adv <= 0) * (ratio >= lo)
    elif mode == "gspo-one-side":
        keep = (seq_ratio <= hi) * (adv >= 0) + (seq_ratio >= lo) * (adv <= 0)
    elif mode == "ring":
        keep = (
            (ratio >= lo) * (ratio <= hi)
            + (adv >= 0) * (ratio <= 1 - o.epsilon_low_prime)
            + (adv <= 0) * (ratio >= 1 + o.epsilon_high_prime)
        )
    else:
        keep = torch.ones_like(ratio).bool()
    if o.weight == "importance_sampling":
        adv = adv * ratio
    elif o.weight == "truncated_importance_sampling":
        adv = adv * torch.clamp(ratio, 1 - o.epsilon_low_prime, 1 + o.epsilon_high_prime)
    elif o.weight == "gspo_importance_sampling":
        adv = adv * seq_ratio
    elif o.weight == "advantage":
        adv = adv * torch.exp(adv / o.temp)
    losses = -adv * logprob * keep.float()
    if o.regularizer == "forward-kl":
        losses = losses - o.regularizer_coef * logprob
    elif o.regularizer == "k2":
        losses = losses + o.regularizer_coef * (logprob - old).square()
    if mode == "gspo-one-side" or loss_agg_mode == "seq-mean-token-mean":
        return _trinity_mean(losses, mask, dim=-1).mean()
    return _trinity_mean(losses, mask)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(
    "mode, weight, regularizer", list(itertools.product(REC_CLIP_MODES, REC_WEIGHTS, REC_REGULARIZERS))
)
def test_rec_equals_trinity(mode, weight, regularizer, agg):
    """Every clip mode × weight × regulariser, with `agg` as Trinity's loss_agg_mode (which
    gspo-one-side ignores there and here)."""
    options = RecOptions(
        clip_mode=mode, weight=weight, regularizer=regularizer, regularizer_coef=0.3,
        epsilon_low_prime=EPS_LOW_PRIME, epsilon_high_prime=EPS_HIGH_PRIME, temp=0.7,
    )  # fmt: skip
    logprobs, old, adv, mask = _batch(seed=7)
    ours, metrics = policy_loss(
        logprobs, old, adv, mask, kind="rec", clip_low=EPS_LOW, clip_high=EPS_HIGH, agg=agg, rec=options
    )
    ref = _trinity_rec(logprobs, old, mask, adv, agg, options)
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(torch.autograd.grad(ours, logprobs)[0], torch.autograd.grad(ref, logprobs)[0], **TOL)
    if mode == "none":
        assert metrics["clipfrac"].item() == 0.0


def test_rec_truncated_weight_is_trinitys_two_sided_clamp():
    """Hand-worked: ratios 1/4, 1, 4 (old logprobs 0), A = 1, clip_mode none, Trinity's default
    ε'_low 0.6 and ε'_high 2: weights clamp(r, 0.4, 3) = 0.4, 1, 3, so the token-mean loss is
    −(0.4·log ¼ + 3·log 4)/3 = −2.6·log 4/3 and its gradient −(0.4, 1, 3)/3."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logprobs = torch.tensor([[math.log(0.25), 0.0, math.log(4.0)]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logprobs, old, torch.tensor([1.0]), torch.ones(1, 3), kind="rec", clip_low=0.2, clip_high=0.2,
        rec=RecOptions(weight="truncated_importance_sampling"),
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(-2.6 * math.log(4.0) / 3, abs=1e-12)
    torch.testing.assert_close(logprobs.grad, -torch.tensor([[0.4, 1.0, 3.0]], dtype=torch.float64) / 3)


def test_rec_gspo_one_side_aggregates_seq_mean_token_mean():
    """Hand-worked: ratios 1 (all kept), A = 1, token losses −log π = (1) and (2, 2, 5): Trinity's
    gspo-one-side loss is the mean of the sequence means (1 + 3)/2 = 2, not the token mean 10/4,
    whatever aggregation is asked for. A token-mean normaliser cannot be used with it."""
    logprobs = torch.tensor([[-1.0, 0.0, 0.0], [-2.0, -2.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    rec = RecOptions(clip_mode="gspo-one-side")
    common = dict(kind="rec", clip_low=0.2, clip_high=0.2, rec=rec)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, _ = policy_loss(logprobs, logprobs, torch.tensor([1.0, 1.0]), mask, agg=agg, **common)
        assert loss.item() == pytest.approx(2.0, abs=1e-12), agg
    loss, _ = policy_loss(
        logprobs, logprobs, torch.tensor([1.0, 1.0]), mask, agg="seq-mean-token-mean", agg_normalizer=2.0, **common
    )
    assert loss.item() == pytest.approx(2.0, abs=1e-12)
    with pytest.raises(ValueError, match="aggregates seq-mean-token-mean"):
        policy_loss(logprobs, logprobs, torch.tensor([1.0, 1.0]), mask, agg="token-mean", agg_normalizer=4.0, **common)


def test_rec_config_gspo_one_side_needs_its_aggregation():
    """The learner's normaliser follows algo.agg, so the config must say seq-mean-token-mean."""
    base = ["algo.kind=rec", "algo.rec.clip_mode=gspo-one-side"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, "algo.agg=token-mean"])
    assert any(p.startswith("algo.agg = token-mean: algo.rec.clip_mode = gspo-one-side") for p in err.value.problems)
    cfg = load_config(None, [*base, "algo.agg=seq-mean-token-mean", "algo.rec.weight=truncated_importance_sampling"])
    options = loss_options(cfg.algo)
    assert options["agg"] == "seq-mean-token-mean"
    assert options["rec"] == RecOptions(
        clip_mode="gspo-one-side", weight="truncated_importance_sampling", epsilon_low_prime=0.6, epsilon_high_prime=2.0
    )
    with pytest.raises(ConfigError, match="algo.rec.is_cap: unknown field"):
        load_config(None, ["algo.kind=rec", "algo.rec.is_cap=2"])


def test_rec_clip_modes_exercise_both_sides():
    """The test batch has tokens on each side of the ranges, so the masks and clamps are not vacuous."""
    logprobs, old, _, mask = _batch(seed=7)
    ratio = torch.exp(logprobs - old)[mask.bool()]
    assert bool((ratio > 1 + EPS_HIGH).any()) and bool((ratio < 1 - EPS_LOW).any())
    assert bool(((ratio > 1 - EPS_LOW) & (ratio < 1 + EPS_HIGH)).any())
    # the truncated weight's clamp acts on both sides, and leaves some ratios as they are
    assert bool((ratio < 1 - EPS_LOW_PRIME).any()) and bool((ratio > 1 + EPS_HIGH_PRIME).any())
    assert bool(((ratio > 1 - EPS_LOW_PRIME) & (ratio < 1 + EPS_HIGH_PRIME)).any())


def test_rec_clipping_is_a_hard_mask_with_reinforce_gradient():
    """Hand-worked: ratios 2 and 1, A = 1, two-side ε = 0.2: only the second token counts, and
    its gradient is −A (the −A·log π form), not PPO's −A·r."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    logprobs = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        logprobs, old, torch.tensor([1.0]), torch.ones(1, 2), kind="rec", clip_low=0.2, clip_high=0.2,
        rec=RecOptions(clip_mode="two-side"),
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(0.0)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5]], dtype=torch.float64))
    assert metrics["clipfrac"].item() == 0.5 and metrics["clipfrac_pos"].item() == 0.5


@pytest.mark.parametrize("kind", ["opmd", "asymre"])
@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_opmd_loss_is_reinforce_over_one_plus_tau(kind, tau, agg):
    logprobs, old, adv, mask = _batch(seed=11)
    ours, _ = policy_loss(logprobs, old, adv, mask, kind=kind, clip_low=0.2, clip_high=0.2, agg=agg, opmd_tau=tau)
    losses = -adv * logprobs
    if agg == "token-mean":
        ref = _trinity_mean(losses, mask) / (1 + tau)
    else:  # verl's form (Trinity's omits the mean over sequences: a constant factor)
        ref = (losses * mask).sum() / (mask.shape[-1] + 1e-8) / (1 + tau) / mask.shape[0]
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(torch.autograd.grad(ours, logprobs)[0], torch.autograd.grad(ref, logprobs)[0], **TOL)


def test_minirl_masks_only_in_the_advantage_direction():
    """ratios [1.5, 0.5, 1.5, 0.5] with A = [+, +, −, −], ε = 0.2: the first (A > 0, r > 1.2)
    and the last (A < 0, r < 0.8) get no gradient; the others give −A·r and ∇ = −A·r/N."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logprobs = torch.tensor([[1.5, 0.5], [1.5, 0.5]], dtype=torch.float64).log().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, metrics = policy_loss(logprobs, old, adv, torch.ones(2, 2), kind="minirl", clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert loss.item() == pytest.approx((-1.0 * 0.5 + 2.0 * 1.5) / 4)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5 / 4], [3.0 / 4, 0.0]], dtype=torch.float64))
    assert metrics["clipfrac"].item() == 0.5
    assert metrics["clipfrac_pos"].item() == 0.25 and metrics["clipfrac_neg"].item() == 0.25


def test_minirl_random_batch_against_its_formula():
    logprobs, old, adv, mask = _batch(seed=3)
    ours, _ = policy_loss(logprobs, old, adv, mask, kind="minirl", clip_low=EPS_LOW, clip_high=EPS_HIGH)
    ratio = torch.exp(logprobs - old)
    r = ratio.detach()
    dropped = ((adv > 0) & (r > 1 + EPS_HIGH)) | ((adv < 0) & (r < 1 - EPS_LOW))
    ref = (-adv * ratio * (~dropped) * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(torch.autograd.grad(ours, logprobs)[0], torch.autograd.grad(ref, logprobs)[0], **TOL)


@pytest.mark.parametrize("kind", ["minirl", "rec", "opmd"])
def test_gradcheck_float64(kind):
    logprobs, old, adv, mask = _batch(seed=5)
    # REC's weights are detached by design (a surrogate: its gradient is not its value's), so
    # gradcheck takes the unweighted form; the weighted ones are checked against Trinity above
    options = RecOptions(clip_mode="one-side", regularizer="k2", regularizer_coef=0.1)

    def fn(lp):
        return policy_loss(lp, old, adv, mask, kind=kind, clip_low=EPS_LOW, clip_high=EPS_HIGH, rec=options)[0]

    # ratios sit away from the mask's edges, so the finite differences do not cross them
    r = torch.exp(logprobs - old).detach()[mask.bool()]
    assert bool(((r - (1 + EPS_HIGH)).abs() > 1e-5).all() and ((r - (1 - EPS_LOW)).abs() > 1e-5).all())
    assert torch.autograd.gradcheck(fn, (logprobs.detach().requires_grad_(True),), eps=1e-7, atol=1e-6)
