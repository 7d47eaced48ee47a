"""Launches a test worker as N real processes (a gloo world on loopback), torchrun-style."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_rlvr.learner.parallel import free_port

WORKER = Path(__file__).with_name("learner_worker.py")


def run_ranks(
    world_size: int, args: list[str], out_dir: Path, timeout_s: float = 300, env: dict | None = None, attempts: int = 3
) -> list[dict]:
    """Runs learner_worker.py on every rank; returns each rank's JSON result. A failing rank
    stops the others at once, and the error names it and shows the end of its log. A port
    taken between choosing and binding it (a race with other sockets) is retried."""
    for attempt in range(attempts):
        failures = _launch(world_size, args, out_dir, timeout_s, env or {})
        if not failures:
            return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
        if not any("EADDRINUSE" in f for f in failures) or attempt + 1 == attempts:
            raise AssertionError("\n".join(failures))
    raise AssertionError("unreachable")


def _launch(world_size: int, args: list[str], out_dir: Path, timeout_s: float, env: dict) -> list[str]:
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
        with open(out_dir / f"rank{rank}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), *args], env=rank_env, stdout=log, stderr=subprocess.STDOUT
                )
            )
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    failures = []
    for rank, proc in enumerate(procs):
        code = proc.wait()
        if code != 0:
            tail = (out_dir / f"rank{rank}.log").read_text()[-3000:]
            failures.append(f"rank {rank} exited {code}:\n{tail}")
    return failures
