"""Packing (name, tensor) pairs into flat uint8 buckets in SGLang's flattened-bucket layout:
one dtype per bucket (offsets stay aligned to the element size), tensors back to back in
order, at most `max_bytes` each (a single larger tensor gets a bucket of its own).

The receiver posts exactly this buffer: SGLang 0.5.23's FlattenedTensorBucket.empty
(srt/weight_sync/tensor_bucket.py) allocates torch.empty(Σ numel·itemsize, dtype=uint8) and
receives it in one broadcast, so both sides post a uint8 collective of the same count (a
test runs SGLang's own code to confirm it)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class Bucket:
    names: list[str]
    dtype: torch.dtype
    shapes: list[list[int]]
    buffer: torch.Tensor  # uint8, contiguous

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def checksum(self) -> str:
        return bucket_checksum(self.buffer)


def bucket_checksum(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.contiguous().cpu().numpy().tobytes()).hexdigest()


def nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * torch.empty((), dtype=dtype).element_size()


def bucket_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a flattened bucket, and the bucket's size. Each offset must
    be aligned to its tensor's element size (SGLang refuses unaligned views)."""
    offsets, cursor = [], 0
    for dtype, shape in zip(dtypes, shapes):
        if cursor % torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"unaligned tensor at byte {cursor} for {dtype}: one dtype per bucket")
        offsets.append(cursor)
        cursor += nbytes(dtype, shape)
    return offsets, cursor


def unpack(buffer: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views into a received bucket, without copying."""
    offsets, total = bucket_layout(dtypes, shapes)
    if buffer.numel() != total:
        raise ValueError(f"bucket holds {buffer.numel()} bytes, its metadata describes {total}")
    return [buffer[o : o + nbytes(d, s)].view(d).view(s) for o, d, s in zip(offsets, dtypes, shapes)]


def pack(named: list[tuple[str, torch.Tensor]]) -> Bucket:
    """One bucket from tensors of one dtype."""
    dtype = named[0][1].dtype
    if any(t.dtype != dtype for _, t in named):
        raise ValueError("a bucket holds one dtype")
    buffer = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in named])
    return Bucket([n for n, _ in named], dtype, [list(t.shape) for _, t in named], buffer)


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], max_bytes: int, device: torch.device | str = "cpu"
) -> Iterator[Bucket]:
    """Streams buckets as the (name, tensor) stream arrives: at most one open bucket per
    dtype, so memory stays bounded by the open buckets, not by the model. Buckets are packed
    on `device`, the update group's (CUDA for NCCL, the host for gloo)."""
    open_: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, tensor in named:
        dtype, size = tensor.dtype, tensor.numel() * tensor.element_size()
        if open_.get(dtype) and sizes[dtype] + size > max_bytes:
            yield pack(open_.pop(dtype))
        if dtype not in open_:
            open_[dtype], sizes[dtype] = [], 0
        open_[dtype].append((name, tensor.detach().to(device)))
        sizes[dtype] += size
    for group in open_.values():
        yield pack(group)
