"""Policy losses for RL on LLMs: GRPO (token-level PPO ratio) and GSPO (sequence-level ratio),
clip-higher, dual clip, MiniRL's mask, the off-policy REINFORCE family (algo/reinforce.py),
the rollout correction (algo/corrections.py), and loss aggregation.

All tensors per token are [B, T] with a 0/1 `mask` of response tokens. Masked positions may
hold garbage (padding logprobs, even inf/nan): they are zeroed before any exp, so they never
reach the loss or its gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rlvr.algo.corrections import RolloutCorrection, rollout_correction
from megatron_rlvr.algo.metrics import k3_kl, masked_mean, mismatch_metrics
from megatron_rlvr.algo.reinforce import RecOptions, rec_aggregation, rec_token_losses, reinforce_token_losses

LOG_RATIO_LIMIT = 20.0


def _token_ratio(log_ratio: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO/PPO: one importance ratio per token."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _sequence_ratio(log_ratio: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: s_i = exp(mean_t log-ratio) over the sequence's tokens. Every token carries the
    value s_i, with the gradient s_i · ∇logπ(y_t) (the "GSPO-token" form), so that averaging
    over a sequence's tokens gives exactly the GSPO paper's ∇s_i."""
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1, keepdim=True) / lengths
    seq_ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).detach()
    safe_logprobs = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
    return seq_ratio * torch.exp(safe_logprobs - safe_logprobs.detach())


RATIO_KINDS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": _token_ratio,
    "gspo": _sequence_ratio,
}


def _token_mean(loss, mask, normalizer):
    denom = normalizer if normalizer is not None else mask.sum().clamp(min=1)
    return loss.sum() / denom


def _seq_mean_token_mean(loss, mask, normalizer):
    lengths = mask.sum(dim=-1)
    seq_loss = loss.sum(dim=-1) / lengths.clamp(min=1)
    denom = normalizer if normalizer is not None else (lengths > 0).sum().clamp(min=1)
    return seq_loss.sum() / denom


def _seq_mean_token_sum_norm(loss, mask, normalizer):
    """Dr.GRPO: per-sequence token sum divided by a constant (the max response length by
    default), so long and short responses are not re-weighted by their own length."""
    norm = normalizer if normalizer is not None else mask.shape[-1]
    n_seq = (mask.sum(dim=-1) > 0).sum().clamp(min=1)
    return (loss.sum(dim=-1) / norm).sum() / n_seq


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


LOSS_KINDS = ("grpo", "gspo", "minirl", "rec", "opmd", "asymre")


def _ppo_token_losses(ratio, advantages, *, clip_low, clip_high, clip_ratio_c):
    """max(−A·r, −A·clip(r)), then for A < 0 the dual clip min(·, −A·c)."""
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_clipped = negative & (per_token > dual_bound)
        per_token = torch.where(negative, torch.minimum(per_token, dual_bound), per_token)
    return per_token, clipped, dual_clipped


def _minirl_token_losses(ratio, advantages, *, clip_low, clip_high):
    """MiniRL: −A·r with no gradient (a hard mask, not PPO's min) where A > 0 and
    r > 1 + ε_high, or A < 0 and r < 1 − ε_low."""
    value = ratio.detach()
    masked = ((advantages > 0) & (value > 1.0 + clip_high)) | ((advantages < 0) & (value < 1.0 - clip_low))
    return -advantages * ratio * (~masked).to(ratio.dtype), masked


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
    agg: str = "token-mean",
    agg_normalizer: float | torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    correction: RolloutCorrection | None = None,
    correction_batch_mean: float | None = None,
    rec: RecOptions | None = None,
    opmd_tau: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss of `kind`. Returns (scalar loss, detached scalar metrics).

    grpo (token ratio) / gspo (sequence ratio): PPO clip to [1 − clip_low, 1 + clip_high];
    clip_ratio_c: dual clip, for A < 0 the per-token loss is capped at −A·c.
    minirl: −A·r masked where the ratio left the clip range in the advantage's direction.
    rec: algo/reinforce.py (clip_low/high are its ε_low/ε_high; its gspo-one-side mode always
    aggregates seq-mean-token-mean, as Trinity-RFT does). opmd, asymre: −A·log π,
    aggregated, divided by 1 + opmd_tau (they differ in their advantages, algo/baselines.py).

    Rollout correction (rollout_logprobs and `correction` both given, algo/corrections.py):
    the per-token loss is multiplied by the IS weights and rejected tokens leave the mask;
    correction_batch_mean: the step-wide mean that batch normalisation divides by
    (corrections.step_correction; None: this call's own). In
    bypass mode the rollout logprobs are the old ones; with bypass_loss "ppo_clip" the ratio
    π/μ already carries the correction (no weights), with "reinforce" the loss is
    −w·A·log π, w from the current policy (detached), whatever `kind` is.

    agg_normalizer: for "token-mean", the global token count of the whole step (across
    micro-batches and data-parallel ranks); for "seq-mean-token-mean", the global sequence
    count; for "seq-mean-token-sum-norm", the per-sequence divisor (default: T). Without it
    the counts are this call's, after rejection. Sequence means count only sequences with at
    least one response token.

    Metrics (masked means over this call's tokens): clipfrac (PPO clip active, or the token
    masked by minirl/rec) with its _pos/_neg parts by the advantage's sign,
    clipfrac_low_side / clipfrac_high_side, clipfrac_lower (dual clip active), approx_kl (k3
    of KL(π_old‖π)), ratio_mean, ratio_max, policy_loss; with a correction: rollout_is_* and
    rollout_rs_* (corrections.correction_metrics); with rollout logprobs: mismatch_*.
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {sorted(LOSS_KINDS)}")
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg={agg!r}: expected one of {sorted(AGGREGATIONS)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)

    mask = mask.to(logprobs.dtype)
    valid = mask.bool()
    zeros = torch.zeros_like(logprobs)
    metrics: dict[str, torch.Tensor] = {}
    weights, loss_mask = None, mask
    reinforce = False
    if correction is not None and rollout_logprobs is not None:
        target = logprobs if correction.bypass else old_logprobs
        weights, loss_mask, corr_metrics = rollout_correction(
            target, rollout_logprobs, advantages, mask, correction, correction_batch_mean
        )
        metrics.update(corr_metrics)
        if correction.bypass:
            old_logprobs = rollout_logprobs
            reinforce = correction.bypass_loss == "reinforce"
            if not reinforce:
                weights = None  # π/μ is the ratio itself: weighting again would count it twice
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), zeros)
    ratio = RATIO_KINDS["gspo" if kind == "gspo" else "grpo"](log_ratio, logprobs, mask)

    clipped = dual_clipped = torch.zeros_like(valid)
    if reinforce or kind in ("opmd", "asymre"):
        per_token = reinforce_token_losses(logprobs, advantages, mask)
    elif kind == "rec":
        rec = rec or RecOptions()
        rec_agg = rec_aggregation(rec, agg)
        if rec_agg != agg and agg_normalizer is not None:
            raise ValueError(f"agg={agg!r} with an agg_normalizer: rec's {rec.clip_mode} aggregates {rec_agg}")
        agg = rec_agg
        per_token, rec_metrics = rec_token_losses(
            logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high, options=rec
        )
        metrics.update(rec_metrics)
    elif kind == "minirl":
        per_token, clipped = _minirl_token_losses(ratio, advantages, clip_low=clip_low, clip_high=clip_high)
    else:
        per_token, clipped, dual_clipped = _ppo_token_losses(
            ratio, advantages, clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c
        )
    if weights is not None:
        per_token = per_token * weights
    per_token = torch.where(loss_mask.bool(), per_token, zeros)
    loss = AGGREGATIONS[agg](per_token, loss_mask, agg_normalizer)
    if kind in ("opmd", "asymre") and not reinforce:
        loss = loss / (1.0 + opmd_tau)

    with torch.no_grad():
        ratio_value = ratio.detach()
        fraction = {"clipfrac": clipped, "clipfrac_lower": dual_clipped}
        fraction.update(
            clipfrac_low_side=clipped & (ratio_value < 1),
            clipfrac_high_side=clipped & (ratio_value > 1),
            clipfrac_pos=clipped & (advantages > 0),
            clipfrac_neg=clipped & (advantages < 0),
        )
        for key, flags in fraction.items():
            metrics.setdefault(key, masked_mean(flags.to(mask.dtype), mask))
        metrics.update(
            approx_kl=k3_kl(log_ratio.detach(), mask),
            ratio_mean=masked_mean(ratio_value, mask),
            ratio_max=torch.where(valid, ratio_value, zeros).max() if valid.any() else zeros.sum(),
            policy_loss=loss.detach(),
        )
        if rollout_logprobs is not None:  # in bypass mode, against the current policy
            learner_side = logprobs if correction is not None and correction.bypass else old_logprobs
            metrics.update(mismatch_metrics(rollout_logprobs, learner_side.detach(), mask))
    return loss, metrics
