"""Baselines and reward shaping for group-relative advantages.

A response's advantage is its (scaled, clipped) reward minus a baseline computed from the
rewards of its prompt's group, optionally divided by the group's std:

- group_mean (GRPO, today's default), group_median;
- rloo: the mean of the *other* responses, r_i − mean_{j≠i} r_j = n/(n−1)·(r_i − mean);
- log_avg_exp (OPMD): τ·log(mean_j exp(r_j/τ)), which tends to the max as τ → 0 and to the
  mean as τ → ∞;
- exponential_moving_average: per prompt, the EMA of its past group means (the group's own
  mean the first time it is seen), updated after use; the state is a small object
  (EmaBaselines) with to_dict/from_dict for checkpoints.

`shift` is added to the baseline (AsymRE: −0.1, a baseline below the mean, which favours
positive samples). A group of one carries no relative signal: its advantage is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlvr.algo.ema_state import EmaBaselines

BASELINE_TYPES = ("group_mean", "group_median", "rloo", "log_avg_exp", "exponential_moving_average")


@dataclass(frozen=True)
class AdvantageOptions:
    """How rewards become advantages (see the module docstring)."""

    baseline_type: str = "group_mean"
    normalize_std: bool = True
    shift: float = 0.0
    tau: float = 1.0
    ema_decay: float = 0.9
    reward_scale: float = 1.0
    reward_clip: float | None = None
    eps: float = 1e-6


def shaped_rewards(rewards: torch.Tensor, options: AdvantageOptions) -> torch.Tensor:
    """reward_scale · r, then clipped to [−reward_clip, reward_clip] when set."""
    rewards = rewards * options.reward_scale
    if options.reward_clip is not None:
        rewards = rewards.clamp(-options.reward_clip, options.reward_clip)
    return rewards


def _baseline(rewards: torch.Tensor, options: AdvantageOptions, ema: float | None) -> torch.Tensor:
    """[n] rewards of one group → baseline per response [n] (before the shift)."""
    n = rewards.shape[0]
    kind = options.baseline_type
    if kind == "group_mean":
        return rewards.mean().expand(n)
    if kind == "group_median":
        return rewards.median().expand(n)  # the lower of the two middle values for even n
    if kind == "rloo":
        return (rewards.sum() - rewards) / (n - 1)
    if kind == "log_avg_exp":
        log_n = torch.log(torch.tensor(float(n), dtype=rewards.dtype))
        return (options.tau * (torch.logsumexp(rewards / options.tau, dim=0) - log_n)).expand(n)
    if kind == "exponential_moving_average":
        return torch.full_like(rewards, rewards.mean().item() if ema is None else ema)
    raise ValueError(f"baseline_type={kind!r}: expected one of {BASELINE_TYPES}")


def advantages_of_groups(
    rewards: list[torch.Tensor],
    options: AdvantageOptions,
    *,
    prompt_ids: list[str] | None = None,
    ema: EmaBaselines | None = None,
) -> list[torch.Tensor]:
    """One advantage tensor per group, in order. The EMA baseline needs `prompt_ids` and
    `ema` (updated in place, after all groups of the call used the values from before it)."""
    if options.baseline_type == "exponential_moving_average" and (prompt_ids is None or ema is None):
        raise ValueError("baseline_type exponential_moving_average needs prompt_ids and an EmaBaselines state")
    out = []
    updates: dict[str, list[float]] = {}
    for index, group in enumerate(rewards):
        group = group.to(torch.promote_types(group.dtype, torch.float32))
        if group.dim() != 1:
            raise ValueError(f"group {index}: rewards must be [n], got shape {tuple(group.shape)}")
        n = group.shape[0]
        if n < 2:
            out.append(torch.zeros_like(group))
            continue
        shaped = shaped_rewards(group, options)
        key = prompt_ids[index] if prompt_ids is not None else ""
        previous = ema.values.get(key) if ema is not None else None
        # Shift by a member first: identical rewards then centre to exactly 0 (a float mean of
        # 0.7s is not exactly 0.7, and that ulp divided by std + eps becomes a fake advantage).
        anchor = shaped[:1]
        centred = (
            shaped
            - anchor
            - (_baseline(shaped - anchor, options, None if previous is None else previous - float(anchor)))
        )
        centred = centred - options.shift
        if options.normalize_std:
            centred = centred / ((shaped - anchor).std(unbiased=True) + options.eps)
        out.append(centred)
        updates.setdefault(key, []).append(float(shaped.mean()))
    if options.baseline_type == "exponential_moving_average" and ema is not None:
        for key, means in updates.items():
            for mean in means:
                old = ema.values.get(key)
                ema.values[key] = mean if old is None else options.ema_decay * old + (1 - options.ema_decay) * mean
    return out
