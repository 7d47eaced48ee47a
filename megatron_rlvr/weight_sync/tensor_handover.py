"""The colocated weight hand-over: the learner's named tensors go to engines in memory through
SGLang's `POST /update_weights_from_tensor`, instead of a broadcast over an update group.

The tensors are packed into the same flattened dtype buckets the broadcast uses
(weight_sync/buckets.py). Each bucket becomes SGLang's flattened_bucket payload,
`{"flattened_tensor": uint8, "metadata": [name, shape, dtype, start_idx, end_idx, numel]}`,
pickled as SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` does
(ForkingPickler, base64), with one entry per engine TP rank. A CUDA bucket pickles to a CUDA
IPC handle whose device is the GPU's UUID (what SGLang's receiver maps back to its own device
index); a CPU bucket is moved into shared memory named by a file (torch's file_system sharing
strategy, the only one an unrelated process can open). The metadata entries are
`types.SimpleNamespace`s, which SGLang's receiver reads by attribute and its unpickler allows,
so the learner needs no SGLang import.

SGLang answers before its device copy of a CUDA payload has finished, so a bucket is kept
alive (never freed, so never reused by the allocator) until the engines' replies AND
`settle_s` after them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import time
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.weight_sync.buckets import Bucket, bucket_layout, buckets, nbytes

SETTLE_S = 1.0  # how long a bucket outlives the engines' replies (their device copy may still run)

_CUDA_DEVICE_ARG = 6  # reduce_tensor's CUDA rebuild args: the device index is the 7th


@dataclass
class HandoverStats:
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def bucket_payload(bucket: Bucket) -> dict:
    """SGLang's flattened_bucket payload for one bucket (its buffer, not a copy)."""
    offsets, _ = bucket_layout([bucket.dtype] * len(bucket.shapes), bucket.shapes)
    metadata = []
    for name, shape, start in zip(bucket.names, bucket.shapes, offsets):
        size = nbytes(bucket.dtype, shape)
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(shape),
                dtype=bucket.dtype,
                start_idx=start,
                end_idx=start + size,
                numel=size,
            )
        )
    return {"flattened_tensor": bucket.buffer, "metadata": metadata}


def serialize(obj: object) -> str:
    """ForkingPickler + base64, as SGLang's MultiprocessingSerializer.serialize(obj,
    output_str=True). CPU tensors are moved into file-named shared memory first."""
    with _file_system_sharing():
        buffer = io.BytesIO()
        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = _reduce_tensor  # this pickler's own table
        pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def _reduce_tensor(tensor: torch.Tensor):
    """torch's own reduction, with a CUDA tensor's device index replaced by its GPU's UUID
    (the receiver's index of the same GPU may differ: other CUDA_VISIBLE_DEVICES)."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


class _Held:
    """Buckets the engines may still be reading, each freed settle_s after its replies."""

    def __init__(self, settle_s: float):
        self.settle_s = settle_s
        self._held: list[tuple[float, Bucket]] = []

    def keep(self, bucket: Bucket) -> None:
        """Called once every engine replied for `bucket`."""
        now = time.monotonic()
        self.free_due(now)
        self._held.append((now + self.settle_s, bucket))

    def free_due(self, now: float) -> None:
        self._held = [(until, bucket) for until, bucket in self._held if until > now]

    async def drain(self) -> None:
        if self._held:
            await asyncio.sleep(max(0.0, self._held[-1][0] - time.monotonic()))
        self._held = []


async def hand_over(
    engines: list[tuple[EngineClient, int]],
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int,
    weight_version: str | None = None,
    device: torch.device | str = "cpu",
    settle_s: float = SETTLE_S,
    timeout_s: float | None = None,
) -> HandoverStats:
    """Hands every (name, tensor) to every engine, given as (client, its TP size): one weight
    update session per engine, one update_weights_from_tensor per bucket (sent to all engines
    at once), then the session's end and a cache flush. Buckets are packed on `device` (CUDA
    on GPU, so the payload is an IPC handle; every TP rank gets the same payload, which is
    right for CPU shared memory and for engines whose ranks share the learner's GPU).
    Each call is bounded by timeout_s (EngineClient's update_timeout_s by default); a refusal
    or a timeout raises with the engine named, and the sessions are left open for the caller's
    error path."""
    stats, held, started = HandoverStats(), _Held(settle_s), time.monotonic()
    await asyncio.gather(*(client.begin_weight_update() for client, _ in engines))
    for bucket in buckets(named, bucket_bytes, device):
        payload = serialize(bucket_payload(bucket))
        await asyncio.gather(
            *(
                client.update_weights_from_tensor(
                    p.UpdateWeightsFromTensorReqInput(
                        serialized_named_tensors=[payload] * tp_size,
                        load_format="flattened_bucket",
                        flush_cache=False,
                        weight_version=weight_version,
                    ),
                    timeout_s=timeout_s,
                )
                for client, tp_size in engines
            )
        )
        held.keep(bucket)
        stats.buckets, stats.tensors, stats.bytes = (
            stats.buckets + 1,
            stats.tensors + len(bucket.names),
            stats.bytes + bucket.nbytes,
        )
    await asyncio.gather(*(client.end_weight_update() for client, _ in engines))
    await asyncio.gather(*(client.flush_cache() for client, _ in engines))
    await held.drain()
    stats.seconds = time.monotonic() - started
    return stats
