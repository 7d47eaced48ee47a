"""Launches a test worker as N real processes (a gloo world on loopback), torchrun-style."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_rlvr.learner.parallel import free_port

WORKER = Path(__file__).with_name("learner_worker.py")


def run_ranks(world_size: int, args: list[str], out_dir: Path, timeout_s: float = 300) -> list[dict]:
    """Runs learner_worker.py on every rank; returns each rank's JSON result. On failure the
    error names the rank and shows the end of its log."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "RESULT": str(out_dir / f"rank{rank}.json")}
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), *args], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    failures = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            code = "timeout"
        log.close()
        if code != 0:
            tail = (out_dir / f"rank{rank}.log").read_text()[-3000:]
            failures.append(f"rank {rank} exited {code}:\n{tail}")
    if failures:
        raise AssertionError("\n".join(failures))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
