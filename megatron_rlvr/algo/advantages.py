"""Group-relative advantages: each response is scored against the other responses to the
same prompt, so no value network is needed."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] (n responses of each of G prompts) → advantages [G, n].

    normalize_std=True (GRPO): (r − mean) / (std + eps), std unbiased (n − 1).
    normalize_std=False (Dr.GRPO / OlmoRL): r − mean; no std division, which the Dr.GRPO
    paper shows biases updates toward too-easy and too-hard prompts.
    A group of one carries no relative signal: its advantage is 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    n = rewards.shape[1]
    if n < 2:
        return torch.zeros_like(rewards)
    # Shift by a member first: identical rewards then centre to exactly 0 (a float mean of
    # 0.7s is not exactly 0.7, and that ulp divided by std + eps becomes a fake advantage).
    shifted = rewards - rewards[:, :1]
    centered = shifted - shifted.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    std = shifted.std(dim=1, keepdim=True, unbiased=True)
    return centered / (std + eps)
