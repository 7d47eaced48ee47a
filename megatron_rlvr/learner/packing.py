"""Packed sequences (trainer.pack_sequences): a budgeted micro-batch's rows concatenated into one
sequence [1, total] for Megatron's THD layout, so no forward pays for padding to the longest row.

The micro-batch keeps its [B, W] data (MicroBatch.data, as the budgeted path cuts it); a
PackedRows says where each row lies in the pack. Row i takes its first `padded[i]` positions:
its extent (up to its last response token; causal attention makes the rest irrelevant) rounded
up to `multiple` (sequence parallel splits the packed sequence over TP, so every row, and thus
the total, is a multiple of tp). Inside the pack, position ids restart at 0 for every row, and
cu_seqlens, the cumulative padded lengths, tell the attention where each row starts: no row
attends to another. A row's padding is part of its sequence, after its real tokens, which causal
attention keeps from ever seeing it (the padded layout's right padding, the same way); so there
is no padding *between* sequences, and no cu_seqlens_padded: transformer-engine rules out its
flash-attention backend for THD with padding between sequences, and its unfused (fp32) backend
for THD at all, so packing needs bf16 (trainer.dtype) and then may use flash or cuDNN attention.

Everything here but `packed_seq_params` is index arithmetic on host tensors, tested on CPU
against hand computations. The forward with PackedSeqParams runs only on transformer-engine's
attention (the local spec's DotProductAttention refuses packed sequences), that is on a GPU: it
is written to Megatron-Core 0.16's documented API (GPTModel.forward's packed_seq_params,
qkv_format "thd") and checked only by the `gpu` test that scripts/gpu_check.py's `packed` step
runs; no machine this was written on had a GPU.

The local attention takes another form of packing instead (sft.pack_sequences): rows that each
hold several sequences back to back, numbered by TrainBatch.segments, under a block-diagonal
causal mask (`block_causal_mask`) with positions restarting per sequence. Rotary embeddings
depend only on the distance between two positions, so a sequence's logits are those of its own
row; attention then costs the square of the row's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Where the rows of a [B, W] micro-batch lie in its packed sequence [1, total]."""

    lengths: torch.Tensor  # [B] long: positions of each row that count (its extent, at least 1)
    padded: torch.Tensor  # [B] long: positions each row takes in the pack (lengths rounded up)

    @property
    def total(self) -> int:
        return int(self.padded.sum())

    @property
    def starts(self) -> torch.Tensor:
        """[B] where each row begins in the pack."""
        return torch.cumsum(self.padded, 0) - self.padded

    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, column) in the [B, W] layout of every packed position, [total] each."""
        row = torch.repeat_interleave(torch.arange(len(self.padded)), self.padded)
        column = torch.arange(self.total) - self.starts[row]
        return row, column


def packed_rows(extents: torch.Tensor, multiple: int = 1) -> PackedRows:
    """The layout of rows with these extents [B] (positions up to the last response token; a
    filler row's 0 counts as 1, so that no sequence is empty), each padded to `multiple`."""
    lengths = extents.long().clamp(min=1)
    padded = torch.tensor([math.ceil(n / multiple) * multiple for n in lengths.tolist()], dtype=torch.long)
    return PackedRows(lengths, padded)


def pack(per_position: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """[B, W, ...] per-position values → [1, total, ...] in packed order."""
    row, column = rows.index()
    return per_position[row, column].unsqueeze(0)


def packed_positions(rows: PackedRows) -> torch.Tensor:
    """[1, total] position ids, restarting at 0 for every row."""
    return rows.index()[1].unsqueeze(0)


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """[B + 1] int32 cumulative lengths, from 0 (flash-attention's and TE's convention)."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def row_starts(rows: PackedRows) -> torch.Tensor:
    """[1, total] bool: each row's first packed position. The logprob computed there is of the
    row's first token predicted from the previous row's last position (whose next token
    belongs to the next row): it never counts."""
    mask = torch.zeros(rows.total, dtype=torch.bool)
    mask[rows.starts] = True
    return mask.unsqueeze(0)


def unpack(packed: torch.Tensor, rows: PackedRows, width: int) -> torch.Tensor:
    """[1, total] per-token values (logprobs, entropy; differentiable) → [B, width], zero at each
    row's position 0 (see row_starts) and past its packed positions, as the padded layout has it."""
    row, column = rows.index()
    values = packed[0].masked_fill(row_starts(rows)[0].to(packed.device), 0.0)
    out = packed.new_zeros(len(rows.padded), width)
    return out.index_put((row.to(packed.device), column.to(packed.device)), values)


def unpack_rows(packed: torch.Tensor, rows: PackedRows) -> list[torch.Tensor]:
    """[total, ...] values in packed order → one [padded[i], ...] tensor per row."""
    return list(packed.split(rows.padded.tolist()))


def packed_seq_params(rows: PackedRows, device: torch.device):
    """Megatron's PackedSeqParams for the pack (THD): cu_seqlens over the positions each row takes
    (its padding included: see the module doc), no _padded variants (they would mean padding
    between sequences); max seqlens are host ints (TE then needs no device-to-host copy)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = cu_seqlens(rows.padded).to(device)
    longest = int(rows.padded.max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids restarting at 0 wherever the sequence number changes along a row."""
    index = torch.arange(segments.shape[1]).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool, True where a query may not attend (Megatron's convention): a later
    position, or one of another sequence."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return ~(same & causal).unsqueeze(1)
