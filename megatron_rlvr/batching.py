"""Scored groups → the learner's batch: tokens right-padded, response masks, rollout
logprobs and policy versions at their token positions, group-relative advantages, and (R3) the engine's routing.

An episode's response holds tokens the model did not sample (tool turns, the template's
boundaries around them: Sample.loss_mask 0). They stay in the sequence, since the later turns
were generated after them, but the batch's response mask is 0 there, so they enter no loss,
entropy, KL, off-policy metric or normaliser (every consumer in algo/ and learner/ reads the
mask); their rollout logprob is 0 and their policy version -1 (none), so they count as no
stale token either. A response's length is its sampled tokens."""

from __future__ import annotations

import math

import torch

from megatron_rlvr.algo.baselines import AdvantageOptions, EmaBaselines, advantages_of_groups
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.rollout.routed_experts import RoutedExpertsError, pack_routed_experts
from megatron_rlvr.samples import Group, Sample


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
        sampled = sampled_positions(s)
        ids[row, :end] = torch.tensor(tokens)
        mask[row, start:end] = sampled.float()
        logprobs = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        rollout[row, start:end] = torch.where(sampled, logprobs, torch.zeros_like(logprobs))
        token_versions = torch.tensor(s.token_versions(), dtype=torch.long)
        versions[row, start:end] = torch.where(sampled, token_versions, torch.full_like(token_versions, -1))
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


def sampled_positions(sample: Sample) -> torch.Tensor:
    """[response tokens] bool: the tokens the model sampled (Sample.sampled_mask), checked
    against the response it describes."""
    where = f"sample {sample.group_id}/{sample.index}"
    if len(sample.rollout_logprobs) != len(sample.response_ids):
        raise ValueError(
            f"{where}: {len(sample.rollout_logprobs)} rollout logprobs for {len(sample.response_ids)} response tokens"
        )
    marks = sample.sampled_mask()
    if len(marks) != len(sample.response_ids) or any(m not in (0, 1) for m in marks):
        raise ValueError(f"{where}: loss_mask must hold one 0 or 1 per response token ({len(sample.response_ids)})")
    return torch.tensor(marks, dtype=torch.bool)


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
    """Response lengths of the samples a step trains on, in tokens the model sampled (an
    episode's tool turns are not its response's length): mean, median, p95, max, and the
    fraction truncated (finish_reason "length": cut at rollout.max_new_tokens, or an episode
    whose last turn was cut). With episodes, also the mean of their tokens the model did not
    sample (tool turns and template boundaries)."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    lengths = sorted(sum(s.sampled_mask()) for s in samples)
    episodes = {}
    if any(s.loss_mask is not None for s in samples):
        unsampled = sum(len(s.response_ids) - sum(s.sampled_mask()) for s in samples)
        episodes["response_length/unsampled_mean"] = unsampled / len(samples)
    return {
        **episodes,
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/p50": float(lengths[(len(lengths) - 1) // 2]),
        "response_length/p95": float(lengths[round(0.95 * (len(lengths) - 1))]),
        "response_length/max": float(lengths[-1]),
        "response_length/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
