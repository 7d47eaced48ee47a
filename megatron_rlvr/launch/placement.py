"""Where each component of a run lives, chosen once from the config (`launch.mode`).

Components (learner ranks, engine hosts, verifier workers, the buffer) are started through a
Placement and reached through Handles, with the same calls whether the object lives in this
process or in a Ray actor on some node: no component asks where it is. Adding a placement
kind (learner and engines colocated on the same GPUs, say) is a new Placement here and a
config value; the components do not change. Learner and engines on the same GPUs
(launch.colocation) are a variant of both placements: engine i takes the GPUs of learner ranks
i·tp .. (i+1)·tp − 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from typing import Any

from megatron_rlvr.config import ResolvedConfig
from megatron_rlvr.stopping import StopSignals


class Role(Enum):
    """What a component needs from where it lives."""

    LEARNER_RANK = "learner rank"  # one rank of the torch.distributed world (a GPU on CUDA)
    ENGINE = "engine"  # owns an engine server process (its GPUs for SGLang on CUDA)
    VERIFIER = "verifier"  # scores responses in its own sandbox processes
    SERVICE = "service"  # light bookkeeping (the buffer)


class Pending(ABC):
    """A call started on a component: done(wait_s) waits at most that long."""

    @abstractmethod
    def done(self, wait_s: float) -> bool: ...

    @abstractmethod
    def result(self) -> Any: ...


class Handle(ABC):
    """A started component."""

    @abstractmethod
    def start(self, method: str, *args) -> Pending:
        """Starts method(*args) on the component (in-process: runs it to the end)."""

    @abstractmethod
    async def call_async(self, method: str, *args) -> Any:
        """Awaits method(*args) without blocking the event loop."""

    def call(self, method: str, *args, stop: StopSignals | None = None, urgent_only: bool = True) -> Any:
        return call_all([self], method, *args, stop=stop, urgent_only=urgent_only)[0]

    def proxy(self) -> AsyncProxy:
        """The component as an object with awaitable methods (the buffer, for the sampler)."""
        return AsyncProxy(self)

    @abstractmethod
    def kill(self) -> None:
        """Ends the component at once (its own close() is the graceful way)."""


class AsyncProxy:
    def __init__(self, handle: Handle):
        self._handle = handle

    def __getattr__(self, name: str) -> Callable:
        async def call(*args):
            return await self._handle.call_async(name, *args)

        return call


def call_all(
    handles: list[Handle], method: str, *args, stop: StopSignals | None = None, urgent_only: bool = True
) -> list:
    """method(*args) on every handle at once; returns their results in order. The first
    failure is raised at once (ranks blocked in a collective with a rank that died would
    otherwise keep the caller waiting). A stop request ends the wait: by default only a
    second one, since the work asked for (a learner step, a checkpoint) is let finish."""
    stop = stop or StopSignals()
    calls = [handle.start(method, *args) for handle in handles]
    waiting = list(calls)

    def all_done(wait_s: float) -> bool:
        while waiting and waiting[0].done(wait_s):
            waiting.pop(0).result()  # raises the component's error
            wait_s = 0.0
        for call in waiting:  # a later one that already failed
            if call.done(0.0):
                call.result()
        return not waiting

    stop.wait_until(
        all_done,
        f"{method} on {len(handles)} {type(handles[0]).__name__}s" if handles else method,
        urgent_only=urgent_only,
    )
    return [call.result() for call in calls]


def close_all(handles: list[Handle], grace_s: float) -> None:
    """close() on every component at once; those not done within grace_s (a rank that waits
    in a collective for one that died) are killed, and so is every one afterwards. Raises
    the first close() failure once all are ended."""
    calls = [handle.start("close") for handle in handles]
    deadline = time.monotonic() + grace_s
    failure: Exception | None = None
    for call in calls:
        if call.done(max(0.0, deadline - time.monotonic())):
            try:
                call.result()
            except Exception as err:
                failure = failure or err
    for handle in handles:
        handle.kill()
    if failure is not None:
        raise failure


# ----------------------------------------------------------------------------- in-process
class _Done(Pending):
    def __init__(self, fn: Callable[[], Any]):
        try:
            self._value, self._error = fn(), None
        except Exception as err:
            self._value, self._error = None, err

    def done(self, wait_s: float) -> bool:
        return True

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class LocalHandle(Handle):
    def __init__(self, obj: Any):
        self.obj = obj

    def start(self, method: str, *args) -> Pending:
        return _Done(lambda: getattr(self.obj, method)(*args))

    async def call_async(self, method: str, *args) -> Any:
        function = getattr(self.obj, method)
        if inspect.iscoroutinefunction(function):
            return await function(*args)
        return await asyncio.to_thread(function, *args)  # blocking work off the event loop

    def kill(self) -> None:
        pass  # nothing outlives this process's own teardown


# ----------------------------------------------------------------------------- Ray
class _RayCall(Pending):
    def __init__(self, ref):
        self._ref = ref

    def done(self, wait_s: float) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], num_returns=1, timeout=wait_s)
        return bool(ready)

    def result(self) -> Any:
        import ray

        return ray.get(self._ref)


class ActorHandle(Handle):
    def __init__(self, actor):
        self.actor = actor

    def start(self, method: str, *args) -> Pending:
        return _RayCall(getattr(self.actor, method).remote(*args))

    async def call_async(self, method: str, *args) -> Any:
        return await getattr(self.actor, method).remote(*args)

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # an actor that is gone already
            ray.kill(self.actor)


# ----------------------------------------------------------------------------- placements
class Placement(ABC):
    """Starts components where this kind of placement puts them."""

    kind: str = ""

    def __init__(self, cfg: ResolvedConfig):
        self.cfg = cfg

    @abstractmethod
    def place(self, role: Role, cls: type, *args, index: int = 0, **kwargs) -> Handle:
        """Starts cls(*args, **kwargs) for `role`; index: which one of its kind (a learner's
        rank, an engine's number)."""

    def share(self, value: Any) -> Any:
        """A large argument that many calls take, stored once (a batch for every rank)."""
        return value

    def engine_gpus(self, index: int) -> list[int] | None:
        """The GPU ids engine `index` may see, where the placement (not the engine's
        process environment) decides them; None: leave CUDA_VISIBLE_DEVICES as it is."""
        return None

    def engine_cpus(self, index: int) -> list[int] | None:
        """The cores engine `index` runs on: its contiguous share of launch.engine_cpus (core ids
        are the node's own, in either placement); None: not pinned."""
        cores = self.cfg.launch.engine_cpus
        if cores is None:
            return None
        per = len(cores) // self.cfg.rollout.num_engines
        return cores[index * per : (index + 1) * per]

    @contextlib.contextmanager
    def session(self, temp_dir: str):
        """What this placement needs running for the whole run (a Ray session)."""
        yield self


def engine_gpus(gpus: list[int] | None, index: int, tp: int) -> list[int]:
    """Engine `index`'s GPU ids in a local run: its tp slice of `gpus`, or by default of the
    GPUs after the learner's GPU 0 (engine 0 gets 1..tp, engine 1 the next tp, ...)."""
    if gpus is None:
        return list(range(1 + index * tp, 1 + (index + 1) * tp))
    return gpus[index * tp : (index + 1) * tp]


class InProcess(Placement):
    """Everything in this process (engines as its child processes): one learner rank, no Ray.
    For debugging and the simplest runs."""

    kind = "local"

    def place(self, role: Role, cls: type, *args, index: int = 0, **kwargs) -> Handle:
        return LocalHandle(cls(*args, **kwargs))

    def engine_gpus(self, index: int) -> list[int] | None:
        """SGLang on CUDA: rollout.engine.gpus' slice for this engine, or by default the GPUs
        after the learner's GPU 0, so SGLang never claims memory on the learner's GPU; colocated,
        the learner's GPU 0 (the config checks one engine of tp 1)."""
        engine = self.cfg.rollout.engine
        if engine.type != "sglang" or engine.device != "cuda":
            return None
        import torch

        from megatron_rlvr.rollout.launcher import EngineStartError

        if self.cfg.launch.colocation.enabled:
            return [0]
        ids = engine_gpus(engine.gpus, index, engine.tp)
        if max(ids) >= torch.cuda.device_count():
            raise EngineStartError(
                f"engine {index}: launch.mode = local puts it on GPUs {ids} (the learner has GPU 0) but "
                f"this machine has {torch.cuda.device_count()}; set rollout.engine.gpus (e.g. [0] to share "
                "the learner's GPU, with a small rollout.engine.mem_fraction_static)"
            )
        return ids


class RayActors(Placement):
    """Every component a Ray actor on a local Ray or an existing cluster. On CUDA, learner
    ranks take one GPU each from one placement group, reserved first and packed, handed out
    node by node so that consecutive ranks (tensor- and expert-parallel groups) share a node;
    SGLang engines take their tensor-parallel GPUs from a group reserved after it; everything
    else takes a sliver of a CPU."""

    kind = "ray"
    SLIVER = {"num_cpus": 0.01}
    ENGINE_SHARE = 0.5  # colocated: Ray's count of a bundle's GPU for the engine host (the rank has the rest)

    def __init__(self, cfg: ResolvedConfig):
        super().__init__(cfg)
        self._learner_bundles: list[int] | None = None  # rank -> bundle, ranks node by node
        self._group: Any = None  # Ray's PlacementGroup for the learner ranks (CUDA learners)
        self._engine_group: Any = None  # and for the SGLang engines on CUDA, one bundle each
        self._bundle_gpus: list[tuple[str, int]] = []  # colocated: each learner bundle's (node, GPU id)

    @contextlib.contextmanager
    def session(self, temp_dir: str):
        from megatron_rlvr.launch.cluster import ray_session

        with ray_session(self.cfg, temp_dir):
            try:
                self._reserve_gpus()
                yield self
            finally:
                self._remove_groups()

    def _reserve_gpus(self) -> None:
        """Reserves the learner's GPUs, then the engines', before anything is placed: the
        learner's group is packed onto as few nodes as it fits (so its tensor-, expert- and
        pipeline-parallel neighbours do not cross the network) and the engines take what is
        left. Engines started first outside any group would be spread one per node by Ray's
        default policy and leave the learner a few GPUs on every node."""
        import ray

        timeout_s = float(os.environ.get("RLVR_PLACEMENT_TIMEOUT_S", 600))
        p, engine = self.cfg.parallel, self.cfg.rollout.engine
        sglang_gpus = engine.type == "sglang" and engine.device == "cuda"
        colocated = self.cfg.launch.colocation.enabled and sglang_gpus and p.device == "cuda"
        if p.device == "cuda":
            world = p.tp * p.pp * p.dp
            # colocated: room in each bundle for an engine host's sliver beside its learner rank
            bundle = {"GPU": 1, "CPU": 1 + (self.SLIVER["num_cpus"] if colocated else 0)}
            self._group = self._ready(
                ray.util.placement_group([bundle] * world, strategy="PACK"), timeout_s, "the learner's"
            )
            nodes = ray.util.placement_group_table(self._group)["bundles_to_node_id"]
            self._learner_bundles = sorted(range(world), key=lambda b: (nodes[b], b))
            if colocated:
                self._bundle_gpus = self._probe_bundles(world, timeout_s)
                return
        if engine.type == "sglang" and engine.device == "cuda":
            bundles = [{"GPU": engine.tp, "CPU": 0.01}] * self.cfg.rollout.num_engines
            self._engine_group = self._ready(
                ray.util.placement_group(bundles, strategy="PACK"), timeout_s, "the engines'"
            )

    @property
    def _engine_tp(self) -> int:
        return getattr(self.cfg.rollout.engine, "tp", 1)  # a CPU engine is one process

    def _probe_bundles(self, world: int, timeout_s: float) -> list[tuple[str, int]]:
        """(node, GPU id) of every learner bundle, asked by a task placed in it, so that a
        colocated engine's server can be shown the GPUs of the ranks it shares (Ray shows its
        host only the one GPU of its own bundle)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=0.01, num_gpus=0.01)
        def where() -> tuple[str, int]:
            return ray.get_runtime_context().get_node_id(), int(ray.get_gpu_ids()[0])

        strategy = functools.partial(PlacementGroupSchedulingStrategy, self._group)
        calls = [
            where.options(scheduling_strategy=strategy(placement_group_bundle_index=b)).remote() for b in range(world)
        ]
        return ray.get(calls, timeout=timeout_s)

    def engine_gpus(self, index: int) -> list[int] | None:
        """Colocated: the GPU ids of the learner ranks engine `index` shares, which must be on
        one node; otherwise Ray's own setting for the actor."""
        if not self._bundle_gpus:
            return None
        assert self._learner_bundles is not None
        tp = self._engine_tp
        shared = [self._bundle_gpus[self._learner_bundles[r]] for r in range(index * tp, (index + 1) * tp)]
        if len({node for node, _ in shared}) > 1:
            from megatron_rlvr.launch.cluster import ClusterError

            raise ClusterError(
                f"engine {index}: its rollout.engine.tp = {tp} GPUs (learner ranks {index * tp}..{(index + 1) * tp - 1}) "
                "span nodes; colocated engines need tp to divide the GPUs of a node"
            )
        return [gpu for _, gpu in shared]

    @staticmethod
    def _ready(group: Any, timeout_s: float, whose: str) -> Any:
        import ray

        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            from megatron_rlvr.launch.cluster import ClusterError

            raise ClusterError(
                f"Ray could not reserve {whose} GPUs within {timeout_s:g} s (RLVR_PLACEMENT_TIMEOUT_S): "
                "are other jobs holding GPUs of this cluster?"
            ) from None
        return group

    def _remove_groups(self) -> None:
        import ray

        for group in (self._group, self._engine_group):
            if group is not None:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(group)
        self._group = self._engine_group = None

    def share(self, value: Any) -> Any:
        import ray

        return ray.put(value)

    def _options(self, role: Role, index: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if role is Role.LEARNER_RANK and self._group is not None:
            # ranks take bundles node by node: Megatron puts tensor-, then expert-parallel
            # neighbours on consecutive ranks, which should share a node
            assert self._learner_bundles is not None
            return {
                "num_gpus": 1 - self.ENGINE_SHARE if self._bundle_gpus else 1,
                "num_cpus": 1,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=self._learner_bundles[index]
                ),
            }
        if role is Role.ENGINE and self._bundle_gpus:  # colocated: beside the first rank it shares
            assert self._learner_bundles is not None
            bundle = self._learner_bundles[index * self._engine_tp]
            return {
                "max_concurrency": 2,
                "num_gpus": self.ENGINE_SHARE,
                **self.SLIVER,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=bundle
                ),
            }
        if role is Role.ENGINE:
            # two threads: stop() must be able to interrupt a start() waiting for health
            if self._engine_group is None:
                return {"max_concurrency": 2, **self.SLIVER}
            return {
                "max_concurrency": 2,
                "num_gpus": self._engine_group.bundle_specs[index]["GPU"],
                **self.SLIVER,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._engine_group, placement_group_bundle_index=index
                ),
            }
        return dict(self.SLIVER)

    def place(self, role: Role, cls: type, *args, index: int = 0, **kwargs) -> Handle:
        import ray

        return ActorHandle(ray.remote(cls).options(**self._options(role, index)).remote(*args, **kwargs))


PLACEMENTS: dict[str, type[Placement]] = {p.kind: p for p in (InProcess, RayActors)}


def placement_for(cfg: ResolvedConfig) -> Placement:
    return PLACEMENTS[cfg.launch.mode](cfg)
