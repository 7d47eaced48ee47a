"""Scored groups → the learner's batch: tokens right-padded, response masks, rollout
logprobs and policy versions at their token positions, group-relative advantages, and (R3) the engine's routing."""

from __future__ import annotations

import math

import torch

from megatron_rlvr.algo.baselines import AdvantageOptions, EmaBaselines, advantages_of_groups
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.rollout.routed_experts import RoutedExpertsError, pack_routed_experts
from megatron_rlvr.samples import Group


def groups_to_batch(
    groups: list[Group],
    *,
    advantage: AdvantageOptions,
    ema: EmaBaselines | None = None,
    pad_id: int = 0,
    routing: tuple[int, int] | None = None,
    slots: int = 1,
    micro_batch_size: int | None = None,
) -> TrainBatch:
    """advantage: the baseline and reward shaping (ema: the per-prompt state of the
    exponential_moving_average baseline, updated here). routing: (num_layers, top_k) to carry the engine's routed experts (R3). slots: the
    learner's mini-batches × data-parallel ranks, each a contiguous run of rows: a batch that
    does not fill them evenly (a short batch at the generation bound) is laid out by
    spread_over_slots."""
    samples = [s for g in groups for s in g.samples]
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    rollout = torch.zeros(len(samples), width)
    versions = torch.full((len(samples), width), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens = s.prompt_ids + s.response_ids
        start, end = len(s.prompt_ids), len(tokens)
        ids[row, :end] = torch.tensor(tokens)
        mask[row, start:end] = 1
        rollout[row, start:end] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        versions[row, start:end] = torch.tensor(s.token_versions(), dtype=torch.long)
    rewards = [torch.tensor([s.reward for s in g.samples], dtype=torch.float32) for g in groups]
    advantages = torch.cat(advantages_of_groups(rewards, advantage, prompt_ids=[g.prompt_id for g in groups], ema=ema))
    batch = TrainBatch(ids, mask, advantages=advantages, rollout_logprobs=rollout, token_versions=versions)
    if routing is not None:
        layers, top_k = routing
        missing = [f"{s.group_id}/{s.index}" for s in samples if s.routed_experts is None]
        if missing:
            raise RoutedExpertsError(f"sample {missing[0]}: the engine returned no routed_experts")
        batch.routed_experts = pack_routed_experts(
            [s.routed_experts for s in samples if s.routed_experts is not None],
            [len(s.prompt_ids) + len(s.response_ids) for s in samples],
            width,
            num_layers=layers,
            top_k=top_k,
            sample_ids=[f"{s.group_id}/{s.index}" for s in samples],
        )
    return spread_over_slots(batch, slots, micro_batch_size)


def spread_over_slots(batch: TrainBatch, slots: int, micro_batch_size: int | None) -> TrainBatch:
    """Lays the rows out so that each of `slots` equal contiguous runs holds real rows (as
    evenly as they go) followed by padding rows, and each run splits into whole micro-batches.
    A padding row repeats a real one with an empty response mask: it counts in no loss,
    normaliser or metric. A batch that already fits is returned as it is."""
    rows = batch.size
    per_slot = math.ceil(rows / slots)
    if micro_batch_size and per_slot > micro_batch_size:
        per_slot = math.ceil(per_slot / micro_batch_size) * micro_batch_size
    if per_slot * slots == rows:
        return batch
    base, extra = divmod(rows, slots)
    index: list[int] = []
    real: list[int] = []
    cursor = 0
    for slot in range(slots):
        take = base + (slot < extra)
        index.extend(range(cursor, cursor + take))
        real.extend([True] * take)
        index.extend([max(cursor + take - 1, 0)] * (per_slot - take))
        real.extend([False] * (per_slot - take))
        cursor += take
    laid_out = batch.select(torch.tensor(index))
    laid_out.response_mask[~torch.tensor(real)] = 0
    return laid_out


def response_length_metrics(groups: list[Group]) -> dict[str, float]:
    """Response lengths (tokens) of the samples a step trains on: mean, median, p95, max, and
    the fraction cut at rollout.max_new_tokens."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    lengths = sorted(len(s.response_ids) for s in samples)
    return {
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/p50": float(lengths[(len(lengths) - 1) // 2]),
        "response_length/p95": float(lengths[round(0.95 * (len(lengths) - 1))]),
        "response_length/max": float(lengths[-1]),
        "response_length/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
