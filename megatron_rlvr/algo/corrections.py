"""Rollout correction: the learner's π_old against the engine's μ, per token.

The engine samples with its own numerics (kernels, dtypes, MoE routing) and, in asynchronous
runs, with older weights, so tokens come from μ ≠ π_old. Two tools, with verl 0.9.1's
`algorithm.rollout_correction` names, values and meaning of thresholds:

- importance weights w = π_old/μ ("rollout_is"): per token, per sequence (the product of its
  tokens' ratios) or, our addition, the sequence's geometric mean; truncated at an upper
  threshold (TIS), or zeroed outside [lower, upper] (IcePop) when a lower one is given;
  optionally divided by their batch mean; detached (they change the measure, not the objective);
- rejection ("rollout_rs"): tokens or whole sequences whose divergence estimate
  (k1 = −log w, k2 = ½(log w)², k3 = w − 1 − log w; per token, or the sequence's sum, mean or
  max) falls outside its threshold leave the loss's mask.

Stale negatives (the positive/negative asymmetry under off-policy data): instead of one
truncation, positive-advantage tokens keep weights up to `positive_cap`, negative ones are
clamped into [negative_floor, negative_cap].

Decoupled PPO (AReaL): loss = −min(r·A, clip(r)·A) · min(π_prox/μ, cap), r = π/π_prox, with
π_prox the learner's policy at the start of the step. That is what the trainer's old-logprob
pass computes (learners.compute_logprobs, with the step's starting weights, before its first
mini-batch; held fixed over the step's mini-batches, as AReaL's prox_logp is). So kind grpo
with rollout_is token and rollout_is_threshold = cap *is* decoupled PPO, exactly (test:
test_decoupled_ppo_is_the_default_loss_with_the_proximal_old_logprobs). AReaL's own
behav_imp_weight_cap zeroes a token whose weight exceeds the cap instead of truncating it:
rollout_is_threshold_lower = 0. It is not decoupled PPO in bypass mode (π_prox = μ: the ratio
π/μ is clipped directly, verl's bypass ppo_clip) nor with rollout_is null (no behaviour weight).

Every function is pure; masked positions may hold garbage and never reach a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from megatron_rlvr.algo.metrics import masked_mean
from megatron_rlvr.config.rejection import RejectionRule

SAFETY_BOUND = 20.0  # |log w| beyond this is clamped before exp, as verl does
IS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class StaleNegativeCaps:
    """Separate weight bounds by the sign of the advantage (A > 0: min(w, positive_cap);
    A ≤ 0: clamp(w, negative_floor, negative_cap))."""

    positive_cap: float = 10.0
    negative_cap: float = 1.0
    negative_floor: float = 0.5


@dataclass(frozen=True)
class RolloutCorrection:
    """What to do with π_old/μ. is_level None: no weights (rejection and metrics only)."""

    is_level: str | None = "token"
    is_upper: float = 2.0
    is_lower: float | None = None
    batch_normalize: bool = False
    rejection: tuple[RejectionRule, ...] = ()
    stale_negatives: StaleNegativeCaps | None = None
    bypass: bool = False
    bypass_loss: str = "ppo_clip"


def _zeroed(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def raw_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Untruncated w per token [B, T] (0 at masked positions): exp(log w) per token, per
    sequence exp(Σ log w), geometric exp(mean log w), each clamped to ±SAFETY_BOUND in log."""
    log_ratio = _zeroed(log_ratio, mask)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    elif level == "geometric":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    elif level != "token":
        raise ValueError(f"rollout_is={level!r}: expected one of {IS_LEVELS}")
    weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(mask)
    return _zeroed(weights, mask)


def weights_mean(weights: torch.Tensor, mask: torch.Tensor, level: str | None) -> torch.Tensor:
    """What batch normalisation divides by: the mean weight over tokens (token level) or over
    non-empty sequences of their per-token mean (the sequence levels)."""
    if level == "token":
        return masked_mean(weights, mask)
    lengths = mask.sum(dim=-1)
    per_seq = weights.sum(dim=-1) / lengths.clamp(min=1)
    return per_seq[lengths > 0].mean() if bool((lengths > 0).any()) else per_seq.sum()


def bounded_weights(
    raw: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    corr: RolloutCorrection,
    batch_mean: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, changed): TIS truncation, IcePop zeroing, or the stale-negative bounds, then
    the optional batch normalisation to mean 1 (weights_mean). batch_mean: that mean taken
    over the whole step's batch (step_correction), so that how the batch is cut into
    micro-batches changes nothing; None: over these rows. `changed` marks tokens whose
    weight the bound altered."""
    if corr.stale_negatives is not None:
        caps = corr.stale_negatives
        positive = advantages > 0
        weights = torch.where(
            positive, raw.clamp(max=caps.positive_cap), raw.clamp(min=caps.negative_floor, max=caps.negative_cap)
        )
        changed = weights != raw
    elif corr.is_lower is None:
        weights = raw.clamp(max=corr.is_upper)
        changed = raw > corr.is_upper
    else:
        kept = (raw >= corr.is_lower) & (raw <= corr.is_upper)
        weights = torch.where(kept, raw, torch.zeros_like(raw))
        changed = ~kept
    weights = _zeroed(weights, mask).detach()
    changed = changed & mask.bool()
    if corr.batch_normalize:
        mean = weights_mean(weights, mask, corr.is_level) if batch_mean is None else batch_mean
        if mean > 1e-8:
            weights = weights / mean
    return weights, changed


def _divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, rules: tuple[RejectionRule, ...]) -> torch.Tensor:
    """0/1 [B, T] (mask's dtype): 1 where every rule passes. Sequence rules reject all of a
    sequence's tokens; k1 rules bound −log w (summed or averaged over a sequence) to
    [log lower, log upper], the others bound the estimate above."""
    valid = mask.bool()
    keep = torch.ones_like(valid)
    per_token = _divergences(_zeroed(log_ratio, mask))
    lengths = mask.sum(dim=-1)
    for rule in rules:
        scope, _, estimator = rule.option.rpartition("_")
        stat = _zeroed(per_token[estimator], mask)
        if scope == "seq_sum":
            stat = stat.sum(dim=-1, keepdim=True)
        elif scope == "seq_mean":
            stat = stat.sum(dim=-1, keepdim=True) / lengths.unsqueeze(-1).clamp(min=1)
        elif scope == "seq_max":
            stat = torch.where(valid, stat, torch.full_like(stat, -math.inf)).amax(dim=-1, keepdim=True)
            stat = torch.where(torch.isinf(stat), torch.zeros_like(stat), stat)
        if rule.lower is not None:
            passes = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
        else:
            passes = stat <= rule.upper
        keep = keep & passes.expand_as(valid)
    return (keep & valid).to(mask.dtype)


def correction_metrics(
    weights: torch.Tensor | None,
    changed: torch.Tensor | None,
    keep: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Weight mean/max and the share of response tokens whose weight was bounded or which
    were rejected, each also split by the sign of the advantage (shares of all tokens, so
    the _pos and _neg parts add up to the whole)."""
    out: dict[str, torch.Tensor] = {}
    valid = mask.bool()
    positive, negative = advantages > 0, advantages < 0
    rejected = valid & ~keep.bool()
    fractions = {"rollout_rs_masked_fraction": rejected}
    if weights is not None and changed is not None:
        out["rollout_is_mean"] = masked_mean(weights, mask)
        out["rollout_is_max"] = _zeroed(weights, mask).max() if valid.any() else weights.sum() * 0
        for sign, select in (("pos", positive), ("neg", negative)):
            out[f"rollout_is_mean_{sign}"] = masked_mean(weights, mask * select)
        fractions["rollout_is_clipfrac"] = changed
    for name, flags in fractions.items():
        out[name] = masked_mean(flags.to(mask.dtype), mask)
        out[f"{name}_pos"] = masked_mean((flags & positive).to(mask.dtype), mask)
        out[f"{name}_neg"] = masked_mean((flags & negative).to(mask.dtype), mask)
    seq_valid = valid.any(dim=-1)
    out["rollout_rs_seq_masked_fraction"] = (rejected.any(dim=-1) & seq_valid).sum() / seq_valid.sum().clamp(min=1)
    return out


def rollout_correction(
    target_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    corr: RolloutCorrection,
    batch_mean: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(weights [B, T] or None, the loss's new 0/1 mask, metrics) for w = target/rollout.
    target: π_old, or in bypass mode the current policy (detached), as verl does.
    batch_mean: see bounded_weights."""
    log_ratio = _zeroed(target_logprobs.detach() - rollout_logprobs, mask)
    advantages = advantages.expand_as(mask)
    weights = changed = None
    if corr.is_level is not None:
        raw = raw_weights(log_ratio, mask, corr.is_level)
        weights, changed = bounded_weights(raw, advantages, mask, corr, batch_mean)
    keep = rejection_keep(log_ratio, mask, corr.rejection) if corr.rejection else mask.clone()
    with torch.no_grad():
        metrics = correction_metrics(weights, changed, keep, advantages, mask)
    return weights, keep, metrics


@dataclass(frozen=True)
class StepCorrection:
    """What a step's correction decides over its whole batch, before any cut into mini- or
    micro-batches: the batch normalisation's mean (None: not normalising) and the tokens
    rejection keeps (they alone count in the loss's normaliser, as verl removes rejected
    tokens from response_mask before its update)."""

    batch_mean: float | None
    keep: torch.Tensor  # [B, T] 0/1, mask's dtype


def step_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    corr: RolloutCorrection,
) -> StepCorrection | None:
    """The step-wide part of the correction; None in bypass mode, where the weights and the
    rejection follow the current policy and are decided per micro-batch (as in verl)."""
    if corr.bypass:
        return None
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    unnormalised = replace(corr, batch_normalize=False)
    weights, keep, _ = rollout_correction(old_logprobs, rollout_logprobs, advantages, mask, unnormalised)
    batch_mean = None
    if corr.batch_normalize and weights is not None:
        batch_mean = float(weights_mean(weights, mask, corr.is_level))
    return StepCorrection(batch_mean, keep)
