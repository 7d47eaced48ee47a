"""The learner's ranks as one object the RL loop calls. Each rank is a LearnerRank placed
where the run's placement puts it (this process for a one-rank local run, one Ray actor per
rank otherwise; the ranks form the torch.distributed world among themselves). Global rank 0 also owns the weight syncer, since
it is the source of every broadcast to the engines."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_rlvr.config import ResolvedConfig
from megatron_rlvr.launch.cluster import node_ip
from megatron_rlvr.launch.placement import Handle, Placement, Role, call_all, close_all
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.rollout.launcher import pin_process
from megatron_rlvr.stopping import StopSignals

if TYPE_CHECKING:
    from megatron_rlvr.learner.offload import LearnerOffload
    from megatron_rlvr.weight_sync.colocated import ColocatedSyncer
    from megatron_rlvr.weight_sync.syncer import WeightSyncer


class LearnerRank:
    def __init__(self, cfg: ResolvedConfig, model_dir: str, rank: int, world_size: int):
        self.cfg, self.model_dir = cfg, model_dir
        self.rank, self.world_size = rank, world_size
        self.learner: Any = None  # learner.learner.Learner, made by setup()
        self.syncer: WeightSyncer | ColocatedSyncer | None = None  # rank 0 only
        self.offload: LearnerOffload | None = None  # launch.colocation.offload_learner
        self.clients: list = []
        self.joined = False
        self.loop = asyncio.new_event_loop()
        cores = cfg.launch.learner_cpus
        self.cores_before: list[int] | None = None  # what close() gives back to a pinned process
        if cores is not None:  # apart from the engines' cores (launch.engine_cpus), as on separate GPUs
            self.cores_before = sorted(os.sched_getaffinity(0))
            pin_process(os.getpid(), cores, f"learner rank {rank} (launch.learner_cpus)")
        if cfg.parallel.device == "cpu":  # ranks of one node share its (or their pinned) cores
            torch.set_num_threads(max(1, (len(cores) if cores else os.cpu_count() or 1) // world_size))

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the other ranks meet this one (asked of rank 0)."""
        from megatron_rlvr.learner.parallel import free_port

        host = node_ip()
        return host, free_port(host)

    def setup(self, master: tuple[str, int], engine_urls: list[str], api_key: str | None = None) -> int | None:
        """Joins the world, builds this rank's model shard; rank 0 joins the engines' weight
        update group (its requests carrying the engines' api_key) and returns their weight version."""
        from megatron_rlvr.learner.learner import Learner
        from megatron_rlvr.learner.parallel import Rendezvous, init_parallel
        from megatron_rlvr.rollout.client import EngineClient
        from megatron_rlvr.weight_sync.syncer import WeightSyncer

        init_parallel(self.cfg.parallel, Rendezvous(self.rank, self.world_size, *master), seed=self.cfg.trainer.seed)
        self.joined = True
        self.learner = Learner(self.cfg, self.model_dir)
        colocation = self.cfg.launch.colocation
        if colocation.enabled and colocation.offload_learner:  # the engines generate first
            from megatron_rlvr.learner.offload import LearnerOffload

            self.offload = LearnerOffload(self.learner)
            self.offload.offload()
        if self.rank != 0:
            return None
        timeout_s = self.cfg.rollout.request_timeout_s
        self.clients = [EngineClient(url, api_key=api_key, timeout_s=timeout_s) for url in engine_urls]
        if colocation.enabled:
            from megatron_rlvr.learner.offload import memory_snapshot
            from megatron_rlvr.weight_sync.colocated import ColocatedSyncer

            device = self.cfg.parallel.device
            self.syncer = ColocatedSyncer(
                self.clients,
                self.cfg,
                engine_ranks=engine_ranks(self.cfg, len(self.clients)),
                memory=lambda: memory_snapshot(device),
            )
            self.loop.run_until_complete(self.syncer.connect())
            return self.syncer.version
        syncer = WeightSyncer(
            self.clients,
            self.cfg.weight_sync,
            master_address=master[0],
            engine_ranks=engine_ranks(self.cfg, len(self.clients)),
        )
        self.syncer = syncer
        self.loop.run_until_complete(syncer.connect())
        return syncer.version

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.learner.compute_logprobs(batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.learner.train_step(batch)

    def sleep_engines(self) -> None:
        """Colocated, before the learner's work: rank 0 has the engines release their memory,
        then every rank takes back what it set aside (weight_sync/colocated.py)."""
        from megatron_rlvr.weight_sync.colocated import ColocatedSyncer

        if isinstance(self.syncer, ColocatedSyncer):
            self.loop.run_until_complete(self.syncer.sleep())
        if self.offload is not None:
            self.offload.onload()
        if isinstance(self.syncer, ColocatedSyncer):
            self.syncer.mark("after_onload")

    def sync_weights(self, version: int, restarted: list[int] | None = None) -> dict:
        from megatron_rlvr.weight_sync.colocated import ColocatedSyncer
        from megatron_rlvr.weight_sync.learner_sync import sync_weights

        syncer = self.syncer
        if isinstance(syncer, ColocatedSyncer):
            syncer.mark("after_train")
        offloaded = self.offload.offload() if self.offload is not None else {}  # before the engines wake
        metrics = sync_weights(self.learner, version, syncer=syncer, loop=self.loop, restarted=restarted)
        if isinstance(syncer, ColocatedSyncer):
            metrics |= offloaded | syncer.take_metrics()
        return metrics

    def save(self, path: str) -> None:
        from megatron_rlvr.learner.checkpoint import save_checkpoint

        save_checkpoint(self.learner, path)

    def load(self, path: str) -> int:
        from megatron_rlvr.learner.checkpoint import load_checkpoint

        return load_checkpoint(self.learner, path)

    def close(self) -> None:
        from megatron_rlvr.learner.parallel import destroy_parallel

        if self.syncer is not None:
            self.loop.run_until_complete(self.syncer.close())
        for client in self.clients:
            self.loop.run_until_complete(client.close())
        if self.learner is not None:
            self.learner.close()
            self.learner = None
        if self.joined:
            destroy_parallel()
        gc.collect()  # the model's own cycles now, so that its groups' threads end with the run
        self.loop.close()
        if self.cores_before is not None:  # a local run's process goes on (the next run checks its cores)
            pin_process(os.getpid(), self.cores_before, f"learner rank {self.rank}")


def engine_ranks(cfg: ResolvedConfig, num_engines: int) -> list[int]:
    """Ranks each engine brings to the weight-update group: SGLang's TP ranks, or one."""
    from megatron_rlvr.weight_sync.transport import engine_rank_count

    engine = cfg.rollout.engine
    per_engine = engine_rank_count(engine.tp, engine.ep) if engine.type == "sglang" else 1
    return [per_engine] * num_engines


class LearnerGroup:
    """Every call is collective: it runs on all ranks and returns rank 0's result."""

    def __init__(self, ranks: list[Handle], placement: Placement, stop: StopSignals):
        self.ranks, self.placement, self.stop = ranks, placement, stop

    @classmethod
    def start(
        cls,
        cfg: ResolvedConfig,
        model_dir: Path,
        engine_urls: list[str],
        placement: Placement,
        stop: StopSignals,
        api_key: str | None = None,
    ) -> tuple[LearnerGroup, int]:
        """The ranks of cfg.parallel's layout, set up (a stop request ends the wait); also the
        engines' weight version."""
        p = cfg.parallel
        world = p.tp * p.pp * p.dp
        ranks = [
            placement.place(Role.LEARNER_RANK, LearnerRank, cfg, str(model_dir), rank, world, index=rank)
            for rank in range(world)
        ]
        group = cls(ranks, placement, stop)
        try:
            master = ranks[0].call("rendezvous_address")
            version = call_all(ranks, "setup", master, engine_urls, api_key, stop=stop, urgent_only=False)[0]
        except BaseException:
            with contextlib.suppress(Exception):  # the failed start's own error is the one to report
                group.close(graceful=False)
            raise
        return group, version

    def _all(self, method: str, *args):
        args = tuple(
            self.placement.share(a) if isinstance(a, TrainBatch) else a for a in args
        )  # one copy for all ranks
        return call_all(self.ranks, method, *args, stop=self.stop)[0]

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._all("compute_logprobs", batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("train_step", batch)

    def sleep_engines(self) -> None:
        """Colocated: the engines release their memory, the learner takes back its own."""
        self._all("sleep_engines")

    def sync_weights(self, version: int, restarted: list[int] | None = None) -> dict:
        """restarted: the engines restarted since they last got weights (they rejoin the group)."""
        return self._all("sync_weights", version, restarted)

    def save(self, path: Path) -> None:
        self._all("save", str(path))

    def load(self, path: Path) -> int:
        return self._all("load", str(path))

    def close(self, graceful: bool = True) -> None:
        """Best effort on every rank: a rank that already failed must not keep others up.
        Ranks busy with earlier work get a few seconds (none unless graceful), then are killed."""
        close_all(self.ranks, grace_s=20.0 if graceful else 0.0)
