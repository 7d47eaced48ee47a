"""The update group between the learner's source rank and the engines, as SGLang forms it:
a NEW process group (not anyone's default world) joined by TCP rendezvous on the learner's
address, through a store prefixed with the group name. The learner is rank 0 and
broadcasts; engine ranks start at their rank_offset. The same group can coexist with the
learner's own torch.distributed world."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def open_group(master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, backend: str, timeout_s: float = 300.0):
    """A process group of its own (not the default world), joined through a prefixed TCP
    store exactly as SGLang joins it: SGLang wraps the store in PrefixStore(group_name) and
    hands it to torch's group helper, which nests PrefixStore(group_name + "/") and then a
    per-device PrefixStore ("cpu/" for gloo, "cuda/" for NCCL). Any other chain of prefixes
    never meets SGLang's keys and both sides wait until the timeout."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: expected gloo or nccl")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    device = "cpu" if backend == "gloo" else "cuda"
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/",
                                                               dist.PrefixStore(group_name, store)))
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return dist.ProcessGroupNCCL(prefixed, rank, world_size)


def broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    """One blocking broadcast on a standalone process group (sender and receivers alike)."""
    group.broadcast(tensor, root).wait()
