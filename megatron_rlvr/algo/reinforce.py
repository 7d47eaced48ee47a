"""The off-policy REINFORCE family of Yao et al. 2025, "Group-Relative REINFORCE Is Secretly an
Off-Policy Algorithm" (REC, OPMD, AsymRE), with Trinity-RFT's formulas, and the plain
REINFORCE loss of verl's bypass mode.

All return a per-token loss [B, T] that the caller weights, masks and aggregates. Their
gradient is that of −A·log π: the ratio r = π/π_old enters only detached (REC's clipping is a
hard mask on the token, not PPO's min, and its weights rescale the advantage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlvr.algo.metrics import masked_mean

REC_CLIP_MODES = ("none", "one-side", "two-side", "ring", "gspo-one-side")
REC_WEIGHTS = ("none", "importance_sampling", "truncated_importance_sampling", "gspo_importance_sampling", "advantage")
REC_REGULARIZERS = ("none", "k2", "forward-kl")
# Trinity-RFT aggregates gspo-one-side's loss this way whatever its loss_agg_mode says.
REC_GSPO_AGGREGATION = "seq-mean-token-mean"


@dataclass(frozen=True)
class RecOptions:
    """REC, as Trinity-RFT's RECPolicyLossFn: which tokens count (clip_mode, with ε_low, ε_high
    and, for ring, ε'_low, ε'_high), how the advantage is weighted (weight; temp for
    "advantage", ε'_low and ε'_high for the truncated ratio) and the regulariser (k2:
    coef·(log π − log π_old)², forward-kl: −coef·log π). The defaults are Trinity's."""

    clip_mode: str = "none"
    weight: str = "none"
    regularizer: str = "none"
    regularizer_coef: float = 0.0
    epsilon_low_prime: float = 0.6
    epsilon_high_prime: float = 2.0
    temp: float = 1.0


def rec_aggregation(options: RecOptions, agg: str) -> str:
    """The aggregation REC's loss takes: seq-mean-token-mean under gspo-one-side, else `agg`."""
    return REC_GSPO_AGGREGATION if options.clip_mode == "gspo-one-side" else agg


def reinforce_token_losses(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """−A·log π per token (masked positions 0, whatever they held)."""
    safe = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
    return -advantages * safe


def rec_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    options: RecOptions,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REC: −w(A)·log π · 1[r in range] (+ regulariser), r = exp(log π − log π_old) detached.

    In range: two-side 1−ε_low ≤ r ≤ 1+ε_high; one-side r ≤ 1+ε_high where A ≥ 0 and
    r ≥ 1−ε_low where A ≤ 0; ring two-side, or r ≤ 1−ε'_low where A ≥ 0, or r ≥ 1+ε'_high
    where A ≤ 0; gspo-one-side one-side on the sequence's geometric-mean ratio s (whose loss
    is aggregated seq-mean-token-mean: rec_aggregation).
    Weights: importance_sampling A·r; truncated_importance_sampling
    A·clamp(r, 1−ε'_low, 1+ε'_high); gspo_importance_sampling A·s; advantage A·exp(A/temp).
    """
    valid = mask.bool()
    zeros = torch.zeros_like(logprobs)
    safe = torch.where(valid, logprobs, zeros)
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), zeros)
    ratio = torch.exp(log_ratio).detach()
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(log_ratio.sum(dim=-1, keepdim=True) / lengths).detach().expand_as(ratio)
    low, high = 1.0 - clip_low, 1.0 + clip_high
    low_prime, high_prime = 1.0 - options.epsilon_low_prime, 1.0 + options.epsilon_high_prime
    pos, neg = advantages >= 0, advantages <= 0
    mode = options.clip_mode
    if mode == "two-side":
        in_range = (ratio >= low) & (ratio <= high)
    elif mode == "one-side":
        in_range = ((ratio <= high) & pos) | ((ratio >= low) & neg)
    elif mode == "gspo-one-side":
        in_range = ((seq_ratio <= high) & pos) | ((seq_ratio >= low) & neg)
    elif mode == "ring":
        in_range = ((ratio >= low) & (ratio <= high)) | (pos & (ratio <= low_prime)) | (neg & (ratio >= high_prime))
    elif mode == "none":
        in_range = torch.ones_like(valid)
    else:
        raise ValueError(f"rec clip_mode={mode!r}: expected one of {REC_CLIP_MODES}")

    weight = options.weight
    if weight == "none":
        weighted = advantages
    elif weight == "importance_sampling":
        weighted = advantages * ratio
    elif weight == "truncated_importance_sampling":
        weighted = advantages * ratio.clamp(low_prime, high_prime)
    elif weight == "gspo_importance_sampling":
        weighted = advantages * seq_ratio
    elif weight == "advantage":
        weighted = advantages * torch.exp(advantages / options.temp)
    else:
        raise ValueError(f"rec weight={weight!r}: expected one of {REC_WEIGHTS}")

    per_token = -weighted * safe * in_range.to(logprobs.dtype)
    if options.regularizer == "forward-kl":
        per_token = per_token - options.regularizer_coef * safe
    elif options.regularizer == "k2":
        per_token = per_token + options.regularizer_coef * log_ratio.square()
    elif options.regularizer != "none":
        raise ValueError(f"rec regularizer={options.regularizer!r}: expected one of {REC_REGULARIZERS}")
    clipped = (~in_range & valid).to(mask.dtype)
    metrics = {
        "clipfrac": masked_mean(clipped, mask),
        "clipfrac_pos": masked_mean(clipped * (advantages > 0), mask),
        "clipfrac_neg": masked_mean(clipped * (advantages < 0), mask),
    }
    return per_token, metrics
