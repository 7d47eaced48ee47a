"""Engine side of the disaggregated weight update, as SGLang does it: the engine has joined
the learner's update group (weight_sync.transport); a flattened bucket is ONE uint8 tensor
holding several tensors of one dtype at aligned byte offsets, received in one broadcast;
per-tensor updates receive one broadcast per tensor."""

from __future__ import annotations

import torch

from megatron_rlvr.weight_sync.buckets import bucket_checksum, bucket_layout, unpack
from megatron_rlvr.weight_sync.transport import broadcast

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPES)})")
    return DTYPES[key]


def receive_bucket(
    group, dtypes: list[torch.dtype], shapes: list[list[int]], checksum: str | None
) -> list[torch.Tensor]:
    """One broadcast of a flattened bucket from rank 0; returns views into it."""
    _, total = bucket_layout(dtypes, shapes)
    buffer = torch.empty(total, dtype=torch.uint8)
    broadcast(group, buffer)
    if checksum is not None and bucket_checksum(buffer) != checksum:
        raise ValueError("bucket checksum mismatch: the received bytes differ from what was sent")
    return unpack(buffer, dtypes, shapes)


def receive_tensors(group, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """One broadcast per tensor (SGLang's format without load_format)."""
    tensors = []
    for dtype, shape in zip(dtypes, shapes):
        tensor = torch.empty(shape, dtype=dtype)
        broadcast(group, tensor)
        tensors.append(tensor)
    return tensors
