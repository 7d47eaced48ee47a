"""Group-relative advantages: each response is scored against the other responses to the
same prompt, so no value network is needed. The baselines and reward shaping are in
algo/baselines.py; this is their default (GRPO's group mean) over a [G, n] table."""

from __future__ import annotations

import torch

from megatron_rlvr.algo.baselines import AdvantageOptions, advantages_of_groups


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] (n responses of each of G prompts) → advantages [G, n].

    normalize_std=True (GRPO): (r − mean) / (std + eps), std unbiased (n − 1).
    normalize_std=False (Dr.GRPO / OlmoRL): r − mean; no std division, which the Dr.GRPO
    paper shows biases updates toward too-easy and too-hard prompts.
    A group of one carries no relative signal: its advantage is 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    if rewards.shape[0] == 0:
        return rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    options = AdvantageOptions(normalize_std=normalize_std, eps=eps)
    return torch.stack(advantages_of_groups(list(rewards), options))
