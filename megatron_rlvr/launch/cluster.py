"""Ray for a run: a local Ray started with explicit CPUs and object-store size (the default),
or an existing cluster's address (Slurm jobs), checked to hold the run before anything
starts; and the address a process is reached at."""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from megatron_rlvr.config import ResolvedConfig, SglangEngine
from megatron_rlvr.errors import UserError

log = logging.getLogger(__name__)


class ClusterError(UserError, RuntimeError):
    """The cluster cannot hold the run, said in one line before anything starts."""


def node_ip() -> str:
    """The address other nodes reach this process at (loopback outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


@contextlib.contextmanager
def ray_session(cfg: ResolvedConfig, temp_dir: str):
    """A local Ray whose session folder (logs, sockets, spilled objects) lives in temp_dir,
    or the cluster at launch.ray_address."""
    import ray

    # Token auth follows leftovers in ~/.ray unless the mode is explicit (see notes).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    launch = cfg.launch
    on_sigterm = signal.getsignal(signal.SIGTERM)
    if launch.ray_address:
        ray.init(address=launch.ray_address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=launch.num_cpus or os.cpu_count(),
            num_gpus=None,
            object_store_memory=launch.object_store_mb * 2**20,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=temp_dir,
        )
    if callable(on_sigterm):  # Ray's crash handler took SIGTERM over: the run's own shutdown comes first
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        check_fits(cfg, ray.cluster_resources())
        yield
    finally:
        ray.shutdown()


def resources_needed(cfg: ResolvedConfig) -> dict[str, float]:
    """GPUs the learner ranks and SGLang engines occupy (colocated: the learner's alone); CPU
    runs need no whole cores."""
    p = cfg.parallel
    world = p.tp * p.pp * (p.dp or 1)
    engine = cfg.rollout.engine
    on_gpus = isinstance(engine, SglangEngine) and engine.device == "cuda"
    if p.device == "cpu" and not on_gpus:
        return {}
    engine_gpus = cfg.rollout.num_engines * engine.tp if isinstance(engine, SglangEngine) and on_gpus else 0
    if cfg.launch.colocation.enabled and p.device == "cuda":
        engine_gpus = 0  # on the learner's GPUs
    return {"GPU": float((world if p.device == "cuda" else 0) + engine_gpus)}


def check_fits(cfg: ResolvedConfig, available: dict[str, float]) -> None:
    for name, amount in resources_needed(cfg).items():
        if available.get(name, 0.0) < amount:
            p = cfg.parallel
            raise ClusterError(
                f"the run needs {amount:g} {name}s (learner tp·pp·dp = {p.tp}·{p.pp}·{p.dp} on "
                f"{p.device}, {cfg.rollout.num_engines} {cfg.rollout.engine.type} engines) but the "
                f"Ray cluster has {available.get(name, 0.0):g}"
            )
