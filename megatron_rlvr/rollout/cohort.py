"""Sequences that decode together in the CPU engine: one HF KV cache, left-padded to a common
length, and for every row the logits of its next token and the weight version they came from.

Continuous batching needs three cache operations: drop finished rows (the cache's own
batch_select_indices), trim padding columns no row needs any more, and merge a cohort of
newcomers into the running one by left-padding both caches to one length. Trimming and
merging touch the cached key/value tensors, which is only sound for plain full-attention
layers (transformers' DynamicLayer); a cache with any other layer kind (sliding window,
linear attention) is never reshaped: its newcomers decode as a cohort of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron_rlvr.rollout.cpu_engine import Sequence


@dataclass
class Cohort:
    seqs: list[Sequence]
    cache: Any  # a transformers Cache holding every row's keys and values
    attention: torch.Tensor  # [B, L] long: 1 where a cached (or next) column is a real token
    positions: torch.Tensor  # [B] long: position id of each row's last fed token
    logits: torch.Tensor  # [B, V] float: each row's next-token logits, not yet sampled
    versions: list[str]  # the weight version each row's logits were computed under

    @property
    def reshapeable(self) -> bool:
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def keep(self, rows: list[int]) -> None:
        """Keeps only these rows (the others finished or left), then drops left columns that
        no remaining row attends to."""
        if len(rows) == len(self.seqs):
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in rows]
        self.versions = [self.versions[i] for i in rows]
        self.cache.batch_select_indices(index)
        self.attention, self.positions, self.logits = self.attention[index], self.positions[index], self.logits[index]
        if self.reshapeable and self.seqs:
            unused = int(self.attention.any(0).long().argmax())  # first column some row attends to
            if unused:
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]
                self.attention = self.attention[:, unused:]

    def merge(self, other: Cohort) -> bool:
        """Takes other's rows in (both left-padded to the longer cache); False when either
        cache cannot be reshaped, and nothing changes."""
        if not (self.reshapeable and other.reshapeable):
            return False
        width = max(self.attention.shape[1], other.attention.shape[1])
        mine, theirs = _left_padded(self, width), _left_padded(other, width)
        for layer, (keys, values), (other_keys, other_values) in zip(self.cache.layers, mine, theirs):
            layer.keys, layer.values = torch.cat([keys, other_keys]), torch.cat([values, other_values])
        self.attention = torch.cat(
            [
                F.pad(self.attention, [width - self.attention.shape[1], 0]),
                F.pad(other.attention, [width - other.attention.shape[1], 0]),
            ]
        )
        self.seqs += other.seqs
        self.versions += other.versions
        self.positions = torch.cat([self.positions, other.positions])
        self.logits = torch.cat([self.logits, other.logits])
        return True


def _left_padded(cohort: Cohort, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    extra = width - cohort.attention.shape[1]
    return [
        (F.pad(layer.keys, [0, 0, extra, 0]), F.pad(layer.values, [0, 0, extra, 0])) for layer in cohort.cache.layers
    ]
