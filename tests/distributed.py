"""Launches a test worker as N real processes (a gloo world on loopback), torchrun-style.

The processes are forked from a multiprocessing fork server that has imported torch,
Megatron-Core and transformers once (about 9 s a process on this machine, two thirds of a
world-1 case): each rank is still its own process, with its own environment, process group
and log, and imports the project's own modules itself, as a launched learner rank does.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import sys
import time
from pathlib import Path

from megatron_rlvr.learner.parallel import free_port

WORKER = Path(__file__).with_name("learner_worker.py")


def run_ranks(
    world_size: int,
    args: list[str],
    out_dir: Path,
    timeout_s: float = 300,
    env: dict | None = None,
    attempts: int = 3,
    worker: Path | None = None,
) -> list[dict]:
    """Runs `worker` (default: WORKER, read at the call, so a test may point it elsewhere) on every rank; returns each rank's JSON result. A failing rank
    stops the others at once, and the error names it and shows the end of its log. A port
    taken between choosing and binding it (a race with other sockets) is retried."""
    for attempt in range(attempts):
        failures = _launch(world_size, args, out_dir, timeout_s, env or {}, worker or WORKER)
        if not failures:
            return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
        if not any("EADDRINUSE" in f for f in failures) or attempt + 1 == attempts:
            raise AssertionError("\n".join(failures))
    raise AssertionError("unreachable")


# third-party modules only, none of which reads the per-rank environment when imported; the
# server starts with one OpenMP thread, as every rank runs (OpenMP reads it when loaded)
PRELOADED = ["torch", "transformers", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer"]
_forks = multiprocessing.get_context("forkserver")
_forks.set_forkserver_preload(PRELOADED)


def _start_fork_server() -> None:
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _rank_main(worker: str, args: list[str], env: dict, log_path: str) -> None:
    """In the forked rank: its environment, its log on stdout and stderr, then the worker."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [worker, *args]
    sys.path.insert(0, str(Path(worker).parent))
    runpy.run_path(worker, run_name="__main__")


def _launch(world_size: int, args: list[str], out_dir: Path, timeout_s: float, env: dict, worker: Path) -> list[str]:
    _start_fork_server()
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "RESULT": str(out_dir / f"rank{rank}.json"),
            **env,
        }
        proc = _forks.Process(target=_rank_main, args=(str(worker), args, rank_env, str(out_dir / f"rank{rank}.log")))
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + timeout_s
    while any(p.exitcode is None for p in procs):
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            break
        time.sleep(0.1)
    failures = []
    for rank, proc in enumerate(procs):
        proc.join()
        if proc.exitcode != 0:
            tail = (out_dir / f"rank{rank}.log").read_text()[-3000:]
            failures.append(f"rank {rank} exited {proc.exitcode}:\n{tail}")
    return failures
