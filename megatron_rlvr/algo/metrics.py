"""Diagnostics of an RL step: KL estimators, train/inference mismatch, routing agreement.

KL estimators follow Schulman's "Approximating KL Divergence": with samples from q and
log_ratio = log p − log q (r = p/q), KL(q‖p) ≈ mean of
  k1 = −log r            (unbiased, high variance, can be negative)
  k2 = (log r)² / 2      (biased, low variance)
  k3 = (r − 1) − log r   (unbiased, low variance, always ≥ 0)
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over positions where mask is 1; 0 when nothing is masked in."""
    mask = mask.to(values.dtype)
    total = torch.where(mask.bool(), values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


def kl_estimate(log_ratio: torch.Tensor, mask: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Masked-mean KL(q‖p) from log_ratio = log p − log q at tokens sampled from q."""
    log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    if kind == "k1":
        per_token = -log_ratio
    elif kind == "k2":
        per_token = 0.5 * log_ratio.square()
    elif kind == "k3":
        per_token = torch.expm1(log_ratio) - log_ratio
    else:
        raise ValueError(f"kind={kind!r}: expected 'k1', 'k2' or 'k3'")
    return masked_mean(per_token, mask)


def k3_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return kl_estimate(log_ratio, mask, "k3")


def mismatch_metrics(
    rollout_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the learner's logprobs of the sampled tokens are from the engine's.

    Drift here (kernels, dtypes, routing) silently biases the gradient; peers' users see it
    grow over a run. Returns mean and max |Δlogp| and the k3 estimate of
    KL(π_rollout ‖ π_train) (tokens were sampled by the rollout policy)."""
    valid = mask.bool()
    diff = torch.where(valid, train_logprobs - rollout_logprobs, torch.zeros_like(train_logprobs))
    abs_diff = diff.abs()
    return {
        "mismatch_abs_mean": masked_mean(abs_diff, mask),
        "mismatch_abs_max": abs_diff.max() if valid.any() else abs_diff.sum(),
        "mismatch_k3_kl": kl_estimate(diff, mask, "k3"),
    }


def routing_agreement(
    experts_a: torch.Tensor, experts_b: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Agreement of two routings given as top-k expert ids [tokens, layers, k].

    `exact`: fraction of (token, layer) pairs whose expert *sets* are equal (order ignored:
    the router's top-k order does not change the MoE output). `overlap`: mean fraction of
    the k experts shared. `per_layer_exact` / `per_layer_overlap`: [layers]. `mask`
    [tokens] selects which tokens count (e.g. response tokens only)."""
    if experts_a.shape != experts_b.shape or experts_a.dim() != 3:
        raise ValueError(
            f"routings must both be [tokens, layers, k]; got {tuple(experts_a.shape)} and {tuple(experts_b.shape)}"
        )
    a = experts_a.long().sort(dim=-1).values
    b = experts_b.long().sort(dim=-1).values
    exact = (a == b).all(dim=-1).float()  # [tokens, layers]
    shared = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(dim=-1).float().mean(dim=-1)
    weight = torch.ones(a.shape[0]) if mask is None else mask.float()
    weight = weight.unsqueeze(-1)
    count = weight.sum().clamp(min=1)
    per_layer_exact = (exact * weight).sum(dim=0) / count
    per_layer_overlap = (shared * weight).sum(dim=0) / count
    return {
        "exact": per_layer_exact.mean(),
        "overlap": per_layer_overlap.mean(),
        "per_layer_exact": per_layer_exact,
        "per_layer_overlap": per_layer_overlap,
    }
