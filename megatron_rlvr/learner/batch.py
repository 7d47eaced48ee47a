"""The learner's view of a rollout batch, and how it is split over mini-batches,
data-parallel ranks and micro-batches.

Per-token tensors are [B, T] aligned with *target* tokens: position t holds the value for
input_ids[b, t] predicted from input_ids[b, :t]; position 0 never counts. Sequences are
right-padded: with causal attention, real tokens never see the padding after them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] long: prompt + response, right-padded
    response_mask: torch.Tensor  # [B, T] float 0/1: response tokens that enter the loss
    advantages: torch.Tensor | None = None  # [B] or [B, T]
    old_logprobs: torch.Tensor | None = None  # [B, T]
    rollout_logprobs: torch.Tensor | None = None  # [B, T]
    routed_experts: torch.Tensor | None = None  # [B, T, num_hidden_layers, top_k]: engine routing (R3)
    token_versions: torch.Tensor | None = None  # [B, T] long: policy version of each response token (-1: none)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> TrainBatch:
        return replace(
            self, **{f.name: getattr(self, f.name)[index] for f in fields(self) if getattr(self, f.name) is not None}
        )

    def padded_to(self, multiple: int) -> TrainBatch:
        """Right-pads T to a multiple (sequence parallel splits the sequence over TP)."""
        extra = (-self.input_ids.shape[1]) % multiple
        if not extra:
            return self

        def pad(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dim() < 2:
                return t
            return torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [0, extra])

        padded: dict[str, Any] = {f.name: pad(getattr(self, f.name)) for f in fields(self)}
        return replace(self, **padded)


def pad_rows(batch: TrainBatch, multiple: int) -> TrainBatch:
    """Repeats the last row until the batch size is a multiple (padding rows count nothing:
    their response mask is zero)."""
    extra = (-batch.size) % multiple
    if not extra:
        return batch
    index = torch.cat([torch.arange(batch.size), torch.full((extra,), batch.size - 1)])
    padded = batch.select(index)
    padded.response_mask[batch.size :] = 0
    return padded


def minibatch_indices(batch_size: int, num_minibatches: int, dp_size: int, dp_rank: int) -> list[torch.Tensor]:
    """Sample indices of this data-parallel rank for each mini-batch: mini-batch k is the k-th
    contiguous slice of the batch, split contiguously over DP ranks. The old-logprob pass and
    the train step both use this, so routing recorded in one is replayed in the other."""
    if batch_size % (num_minibatches * dp_size):
        raise ValueError(
            f"batch of {batch_size} samples does not split into {num_minibatches} mini-batches "
            f"× {dp_size} data-parallel ranks"
        )
    per_rank = batch_size // (num_minibatches * dp_size)
    return [torch.arange(per_rank) + (k * dp_size + dp_rank) * per_rank for k in range(num_minibatches)]


def micro_batches(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    micro_batch_size = min(micro_batch_size, batch.size)
    if batch.size % micro_batch_size:
        raise ValueError(f"{batch.size} samples per rank do not split into micro-batches of {micro_batch_size}")
    return [batch.select(torch.arange(i, i + micro_batch_size)) for i in range(0, batch.size, micro_batch_size)]
