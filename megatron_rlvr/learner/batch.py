"""The learner's view of a rollout batch, and how it is split over mini-batches,
data-parallel ranks and micro-batches.

Per-token tensors are [B, T] aligned with *target* tokens: position t holds the value for
input_ids[b, t] predicted from input_ids[b, :t]; position 0 never counts. Sequences are
right-padded: with causal attention, real tokens never see the padding after them.

Under a token budget each micro-batch is padded only to its own longest row. With
trainer.pack_sequences (GPU only: the local spec's DotProductAttention, the CPU learner's,
refuses packed sequences; transformer-engine's takes them) its rows are concatenated into one
sequence instead (learner/packing.py) and a micro-batch costs the sum of its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from megatron_rlvr.learner.packing import PackedRows, packed_rows


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] long: prompt + response, right-padded
    response_mask: torch.Tensor  # [B, T] float 0/1: response tokens that enter the loss
    advantages: torch.Tensor | None = None  # [B] or [B, T]
    old_logprobs: torch.Tensor | None = None  # [B, T]
    rollout_logprobs: torch.Tensor | None = None  # [B, T]
    routed_experts: torch.Tensor | None = None  # [B, T, num_hidden_layers, top_k]: engine routing (R3)
    token_versions: torch.Tensor | None = None  # [B, T] long: policy version of each response token (-1: none)
    kept: torch.Tensor | None = None  # [B, T] 0/1: tokens the step's rollout rejection keeps (None: all)
    segments: torch.Tensor | None = None  # [B, T] long: packed sequences' numbers (sft.pack_sequences)

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

    def trimmed_to(self, width: int) -> TrainBatch:
        """The first `width` positions of every per-token tensor (right-padded to it if shorter)."""
        padded = self.padded_to(width) if width > self.input_ids.shape[1] else self
        return replace(
            padded,
            **{
                f.name: t[:, :width]
                for f in fields(padded)
                if (t := getattr(padded, f.name)) is not None and t.dim() >= 2
            },
        )


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


def micro_batches(batch: TrainBatch, rows: torch.Tensor, micro_batch_size: int) -> list[MicroBatch]:
    """`rows` (indices of `batch`) in micro-batches of micro_batch_size rows, each as wide as the batch."""
    micro_batch_size = min(micro_batch_size, len(rows))
    if len(rows) % micro_batch_size:
        raise ValueError(f"{len(rows)} samples per rank do not split into micro-batches of {micro_batch_size}")
    chunks = rows.split(micro_batch_size)
    return [MicroBatch(batch.select(chunk), chunk) for chunk in chunks]


# ----------------------------------------------------------------------------- token budgets
@dataclass
class MicroBatch:
    """One forward's rows: `data` (under a token budget trimmed to its longest row) and `rows`, the indices of
    those rows in `batch` (a filler micro-batch, which only keeps the data-parallel ranks'
    forward counts equal, holds one masked row and no index)."""

    data: TrainBatch
    rows: torch.Tensor
    packed: PackedRows | None = None  # trainer.pack_sequences: where data's rows lie in one sequence


def row_extents(batch: TrainBatch) -> torch.Tensor:
    """Positions each row needs [B]: up to its last response token (causal attention: later
    positions change nothing before them); 0 for a row with no response token."""
    positions = torch.arange(1, batch.input_ids.shape[1] + 1).expand_as(batch.response_mask)
    return torch.where(batch.response_mask > 0, positions, torch.zeros_like(positions)).amax(dim=1)


def _width(extent: int, multiple: int) -> int:
    return max(math.ceil(extent / multiple) * multiple, multiple)


def budget_bins(extents: list[int], max_tokens: int, multiple: int = 1, packed: bool = False) -> list[list[int]]:
    """First-fit decreasing: rows longest first, each into the first micro-batch whose cost,
    rows × its longest row (rounded up to `multiple`), or packed the sum of its rows (each
    rounded up), stays within max_tokens. A row longer than the budget gets a micro-batch of its
    own; rows with no tokens go nowhere."""
    order = sorted((i for i, n in enumerate(extents) if n > 0), key=lambda i: (-extents[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for row in order:
        for j, b in enumerate(bins):
            cost = (
                used[j] + _width(extents[row], multiple) if packed else (len(b) + 1) * _width(extents[b[0]], multiple)
            )
            if cost <= max_tokens:
                b.append(row)
                used[j] += _width(extents[row], multiple)
                break
        else:
            bins.append([row])
            used.append(_width(extents[row], multiple))
    return bins


def even_out(bins: list[list[int]], count: int) -> list[list[int]]:
    """Splits the fullest micro-batches in two (then adds empty ones) until there are `count`:
    every data-parallel rank runs as many forwards (expert parallel exchanges tokens in each)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        fullest = max(range(len(bins)), key=lambda i: len(bins[i]), default=None)
        if fullest is None or len(bins[fullest]) < 2:
            bins.append([])
            continue
        b = bins.pop(fullest)
        bins[fullest:fullest] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return bins


def budget_micro_batches(
    batch: TrainBatch,
    rows_per_rank: list[torch.Tensor],
    rank: int,
    max_tokens: int,
    multiple: int = 1,
    packed: bool = False,
) -> tuple[list[MicroBatch], list[int]]:
    """This rank's micro-batches of `rows_per_rank[rank]` (indices of `batch`) under a token
    budget, as many as the data-parallel rank with the most, each trimmed to its longest row
    (rounded up to `multiple`: sequence parallel splits positions over TP); and the widths
    of the rows longer than the budget. Every rank plans every rank's cut from the same batch, so no
    rank asks another. `packed`: micro-batches cost the sum of their rows and carry their packing."""
    extents = row_extents(batch)
    plans = [budget_bins(extents[rows].tolist(), max_tokens, multiple, packed) for rows in rows_per_rank]
    mine = rows_per_rank[rank]
    micro = []
    for b in even_out(plans[rank], max(len(p) for p in plans)):
        rows = mine[torch.tensor(b, dtype=torch.long)]
        if len(rows):
            data = batch.select(rows).trimmed_to(_width(int(extents[rows].max()), multiple))
        else:
            data = batch.select(mine[:1]).trimmed_to(multiple)
            data.response_mask.zero_()
        layout = packed_rows(extents[rows] if len(rows) else torch.zeros(1), multiple) if packed else None
        micro.append(MicroBatch(data, rows, layout))
    over = [width for i in mine if (width := _width(int(extents[i]), multiple)) > max_tokens]
    return micro, over
