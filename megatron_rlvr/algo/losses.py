"""Policy losses for RL on LLMs: GRPO (token-level PPO ratio) and GSPO (sequence-level ratio),
clip-higher, dual clip, truncated importance sampling (TIS), and loss aggregation.

All tensors per token are [B, T] with a 0/1 `mask` of response tokens. Masked positions may
hold garbage (padding logprobs, even inf/nan): they are zeroed before any exp, so they never
reach the loss or its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron_rlvr.algo.metrics import k3_kl, masked_mean, mismatch_metrics

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


def _tis_weight(old_logprobs, rollout_logprobs, mask, cap: float, level: str) -> torch.Tensor:
    """min(π_old/π_rollout, cap), per token or per sequence, detached: corrects for the
    rollout engine's numerics differing from the learner's without exploding variance."""
    log_w = torch.where(mask.bool(), old_logprobs - rollout_logprobs, torch.zeros_like(mask))
    if level == "sequence":
        log_w = log_w.sum(dim=-1, keepdim=True).expand_as(mask)
    elif level != "token":
        raise ValueError(f"tis_level={level!r}: expected 'token' or 'sequence'")
    return torch.exp(log_w.clamp(max=math.log(cap))).detach()


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
    tis_cap: float | None = None,
    tis_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss. Returns (scalar loss, detached scalar metrics).

    kind: "grpo" (token ratio) or "gspo" (sequence ratio), clipped to
    [1 − clip_low, 1 + clip_high]. clip_ratio_c: dual clip — for negative advantages the
    per-token loss is capped at −A·c. TIS (rollout_logprobs and tis_cap both given): the
    per-token loss is weighted by min(π_old/π_rollout, cap) at `tis_level`.
    agg_normalizer: for "token-mean", the global token count of the whole step (across
    micro-batches and data-parallel ranks); for "seq-mean-token-mean", the global sequence
    count; for "seq-mean-token-sum-norm", the per-sequence divisor (default: T).
    Sequence means count only sequences with at least one response token.

    Metrics (masked means over this call's tokens): clipfrac (PPO clip active),
    clipfrac_low_side / clipfrac_high_side (which bound), clipfrac_lower (dual clip active,
    the lower bound on negative-advantage loss), approx_kl (k3 of KL(π_old‖π)), ratio_mean,
    ratio_max, policy_loss; with TIS: tis_weight_mean, tis_clipfrac; with rollout logprobs:
    mismatch_abs_mean, mismatch_abs_max, mismatch_k3_kl.
    """
    if kind not in RATIO_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {sorted(RATIO_KINDS)}")
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
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), zeros)
    ratio = RATIO_KINDS[kind](log_ratio, logprobs, mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(valid)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_clipped = negative & (per_token > dual_bound)
        per_token = torch.where(negative, torch.minimum(per_token, dual_bound), per_token)

    metrics: dict[str, torch.Tensor] = {}
    if rollout_logprobs is not None and tis_cap is not None:
        weight = _tis_weight(old_logprobs.detach(), rollout_logprobs, mask, tis_cap, tis_level)
        per_token = per_token * weight
        metrics["tis_weight_mean"] = masked_mean(weight, mask)
        metrics["tis_clipfrac"] = masked_mean((weight >= tis_cap).to(mask.dtype), mask)
    per_token = torch.where(valid, per_token, zeros)
    loss = AGGREGATIONS[agg](per_token, mask, agg_normalizer)

    with torch.no_grad():
        ratio_value = ratio.detach()
        metrics.update(
            clipfrac=masked_mean(clipped.to(mask.dtype), mask),
            clipfrac_lower=masked_mean(dual_clipped.to(mask.dtype), mask),
            clipfrac_low_side=masked_mean((clipped & (ratio_value < 1)).to(mask.dtype), mask),
            clipfrac_high_side=masked_mean((clipped & (ratio_value > 1)).to(mask.dtype), mask),
            approx_kl=k3_kl(log_ratio.detach(), mask),
            ratio_mean=masked_mean(ratio_value, mask),
            ratio_max=torch.where(valid, ratio_value, zeros).max() if valid.any() else zeros.sum(),
            policy_loss=loss.detach(),
        )
        if rollout_logprobs is not None:
            metrics.update(mismatch_metrics(rollout_logprobs, old_logprobs.detach(), mask))
    return loss, metrics
