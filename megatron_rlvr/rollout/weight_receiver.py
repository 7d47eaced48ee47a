"""Engine side of the disaggregated weight update, as SGLang does it.

The engine joins a NEW process group (not a default world) by TCP rendezvous: a store client
on the learner's master address, prefixed with the group name; the learner is rank 0 and
broadcasts from it. A flattened bucket is ONE uint8 tensor holding several tensors of one
dtype at byte offsets aligned to that dtype; per-tensor updates broadcast each tensor.
"""

from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}


def dtype_from_name(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPES)})")
    return DTYPES[key]


def bucket_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a flattened bucket, and the bucket's size. Offsets must
    be aligned to each tensor's element size (SGLang refuses unaligned views)."""
    offsets, cursor = [], 0
    for dtype, shape in zip(dtypes, shapes):
        size = torch.empty((), dtype=dtype).element_size()
        if cursor % size:
            raise ValueError(f"unaligned tensor at byte {cursor} for {dtype}: one dtype per bucket")
        offsets.append(cursor)
        numel = 1
        for dim in shape:
            numel *= dim
        cursor += numel * size
    return offsets, cursor


def bucket_checksum(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.contiguous().numpy().tobytes()).hexdigest()


def open_group(master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, backend: str, timeout_s: float = 300.0):
    """A process group of its own (not the default world), joined through a prefixed TCP
    store: the same group can coexist with a learner's own torch.distributed world."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    raise ValueError(f"backend {backend!r}: expected gloo or nccl")


def broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    """One blocking broadcast on a standalone process group (sender and receivers alike)."""
    group.broadcast(tensor, root).wait()


def receive_bucket(group, dtypes: list[torch.dtype], shapes: list[list[int]],
                   checksum: str | None) -> list[torch.Tensor]:
    """One broadcast of a flattened bucket from rank 0; returns views into it."""
    offsets, total = bucket_layout(dtypes, shapes)
    buffer = torch.empty(total, dtype=torch.uint8)
    broadcast(group, buffer)
    if checksum is not None and bucket_checksum(buffer) != checksum:
        raise ValueError("bucket checksum mismatch: the received bytes differ from what was sent")
    return [buffer[o : o + _nbytes(d, s)].view(d).view(s) for o, d, s in zip(offsets, dtypes, shapes)]


def receive_tensors(group, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """One broadcast per tensor (SGLang's format without load_format)."""
    tensors = []
    for dtype, shape in zip(dtypes, shapes):
        tensor = torch.empty(shape, dtype=dtype)
        broadcast(group, tensor)
        tensors.append(tensor)
    return tensors


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * torch.empty((), dtype=dtype).element_size()
