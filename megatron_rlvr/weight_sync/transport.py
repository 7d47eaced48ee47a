"""The update group between the learner's source rank and the engines, as SGLang forms it:
a NEW process group (not anyone's default world) joined by TCP rendezvous on the learner's
address, through a store prefixed with the group name. The learner is rank 0 and
broadcasts; engine ranks start at their rank_offset. The same group can coexist with the
learner's own torch.distributed world."""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class GroupLayout:
    """The weight-update group over some engines: the learner's source rank is 0, engine k's
    ranks are offsets[k] .. offsets[k] + ranks[k] - 1 (SGLang: rank = rank_offset + tp_rank)."""

    world_size: int
    offsets: list[int]


def engine_rank_count(tp: int, ep: int = 1) -> int:
    """Ranks one SGLang engine brings to the group: one per TP rank. Its expert-parallel ranks
    are those same TP ranks (ep divides tp), so ep adds none."""
    if tp < 1 or ep < 1 or tp % ep:
        raise ValueError(f"engine layout tp {tp}, ep {ep}: ep must divide tp")
    return tp


def group_layout(engine_ranks: list[int]) -> GroupLayout:
    """World size 1 + Σ ranks and each engine's rank_offset, for engines in the given order."""
    if any(r < 1 for r in engine_ranks):
        raise ValueError(f"engine rank counts {engine_ranks}: each must be >= 1")
    offsets, next_rank = [], 1
    for ranks in engine_ranks:
        offsets.append(next_rank)
        next_rank += ranks
    return GroupLayout(next_rank, offsets)


def bucket_device(backend: str) -> torch.device:
    """Where buckets are packed and broadcast from: NCCL moves CUDA memory only (the learner
    rank's current GPU), gloo sends from host memory."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
):
    """A process group of its own (not the default world), joined through a prefixed TCP
    store exactly as SGLang joins it: SGLang wraps the store in PrefixStore(group_name) and
    hands it to torch's group helper, which nests PrefixStore(group_name + "/") and then a
    per-device PrefixStore ("cpu/" for gloo, "cuda/" for NCCL). Any other chain of prefixes
    never meets SGLang's keys and both sides wait until the timeout."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: expected gloo or nccl")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    device = "cpu" if backend == "gloo" else "cuda"
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return dist.ProcessGroupNCCL(prefixed, rank, world_size)  # type: ignore[call-arg]  # options: its stub omits the default


def broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    """One broadcast on a standalone process group (sender and receivers alike), complete on
    return: NCCL's wait() only orders the GPU stream, so the host waits for the stream too."""
    group.broadcast(tensor, root).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def abort_group(group) -> None:
    """Tears down a group whose collective can no longer be matched (an engine refused its
    bucket after the broadcast was posted): NCCL aborts its communicator, so neither side
    hangs until the watchdog; gloo's pending broadcast ends at the group's timeout (or at
    once when its peer's process is gone), in its daemon thread (see in_daemon_thread)."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        abort()


async def in_daemon_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) in a daemon thread, awaited. A collective whose peer never comes waits out
    the group's timeout (minutes) where it is; asyncio.to_thread's executor threads are
    joined at interpreter exit and would keep the process alive that long, past any stop
    bound. Cancelling the wait abandons the thread; its outcome is dropped."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result, error: BaseException | None) -> None:
        if future.done():  # cancelled: nobody waits for it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        outcome: tuple[T | None, BaseException | None]
        try:
            outcome = (fn(*args), None)
        except BaseException as err:  # handed to the waiter
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the process is going away
            pass

    threading.Thread(target=run, daemon=True, name=f"collective-{getattr(fn, '__name__', 'call')}").start()
    return await future
