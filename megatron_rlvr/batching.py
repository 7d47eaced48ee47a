"""Scored groups → the learner's batch: tokens right-padded, response masks, rollout
logprobs at their token positions, group-relative advantages, and (R3) the engine's routing."""

from __future__ import annotations

import torch

from megatron_rlvr.algo.advantages import group_advantages
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.rollout.routed_experts import pack_routed_experts
from megatron_rlvr.samples import Group


def groups_to_batch(groups: list[Group], *, normalize_std: bool, pad_id: int = 0,
                    routing: tuple[int, int] | None = None) -> TrainBatch:
    """routing: (num_layers, top_k) to carry the engine's routed experts (R3)."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    rollout = torch.zeros(len(samples), width)
    for row, s in enumerate(samples):
        tokens = s.prompt_ids + s.response_ids
        start, end = len(s.prompt_ids), len(tokens)
        ids[row, :end] = torch.tensor(tokens)
        mask[row, start:end] = 1
        rollout[row, start:end] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    advantages = torch.cat([
        group_advantages(torch.tensor([[s.reward for s in g.samples]], dtype=torch.float32),
                         normalize_std=normalize_std)[0]
        for g in groups
    ])
    batch = TrainBatch(ids, mask, advantages=advantages, rollout_logprobs=rollout)
    if routing is not None:
        layers, top_k = routing
        batch.routed_experts = pack_routed_experts(
            [s.routed_experts for s in samples], [len(s.prompt_ids) + len(s.response_ids) for s in samples],
            width, num_layers=layers, top_k=top_k, sample_ids=[f"{s.group_id}/{s.index}" for s in samples])
    return batch
