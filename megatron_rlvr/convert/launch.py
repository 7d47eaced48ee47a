"""Runs a conversion as one process per rank of its layout (a gloo world on CPU, NCCL on GPU)
on this machine, and turns a failing rank into one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_rlvr.config import Config, HFModel, ParallelConfig, ResolvedParallel, resolve
from megatron_rlvr.convert.checks import ConvertError
from megatron_rlvr.stopping import StopSignals


def resolve_layout(config_dir: str | Path, layout: dict, device: str) -> ResolvedParallel:
    """The layout as a run resolves it (etp = tp, the smallest dp that fits ep · etp, sequence
    parallel with tp), checked against the model's heads, experts and layers. A conversion
    has no batches: one sized so that any dp divides it keeps run-only checks quiet."""
    from megatron_rlvr.config import BufferConfig, ConfigError

    experts = (layout["ep"] or 1) * (layout["etp"] or layout["tp"] or 1)
    cfg = Config(
        model=HFModel(path=str(config_dir)),
        buffer=BufferConfig(batch_groups=experts),
        parallel=ParallelConfig(device=device, **{k: v for k, v in layout.items() if v}),
    )
    try:
        return resolve(cfg).parallel
    except ConfigError as err:
        raise ConvertError(err.problems[0].replace("parallel.", "--")) from err


def run_ranks(
    job: dict, parallel: ResolvedParallel, workdir: Path, attempts: int = 3, stop: StopSignals | None = None
) -> list[dict]:
    """Starts the ranks, waits for all of them, and returns each rank's result. The first rank
    to fail stops the others (they would wait forever in a collective) and its one-line error
    is raised as ConvertError. A rendezvous port taken meanwhile is retried. A stop request
    stops every rank (StopRequested)."""
    from megatron_rlvr.convert.worker import PORT_TAKEN
    from megatron_rlvr.learner.parallel import free_port

    world = parallel.tp * parallel.pp * parallel.dp
    job_path = workdir / "job.json"
    job_path.write_text(json.dumps({**job, "parallel": parallel.model_dump(), "workdir": str(workdir)}))
    for _ in range(attempts):
        codes = _start_and_wait(job_path, world, free_port(), workdir, parallel.device, stop or StopSignals())
        if PORT_TAKEN not in codes:
            break
    results = [
        json.loads(p.read_text()) if p.exists() else {} for p in (workdir / f"rank{rank}.json" for rank in range(world))
    ]
    for result in results:
        if "error" in result:
            raise ConvertError(result["error"])
    for rank, code in enumerate(codes):
        if code not in (0, None):  # None: stopped by us after another rank failed
            log = workdir / f"rank{rank}.log"
            where = f"; its log: {log}" if log.exists() else " (its output is above)"
            raise ConvertError(f"rank {rank} of {world} failed with exit code {code}{where}")
    return results


def _start_and_wait(
    job_path: Path, world: int, port: int, workdir: Path, device: str, stop: StopSignals
) -> list[int | None]:
    """Exit codes per rank; None for a rank stopped because another one failed (or because
    this process was interrupted: no rank outlives it)."""
    threads = max(1, (os.cpu_count() or 1) // world) if device == "cpu" else 1
    procs, logs = [], []
    try:
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(threads),
            }
            # rank 0 talks to the user (progress bars); the others keep a log for when they fail
            log = None if rank == 0 else open(workdir / f"rank{rank}.log", "w")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "megatron_rlvr.convert.worker", str(job_path)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT if log else None,
                )
            )

        def ended(poll_s: float) -> bool:
            time.sleep(poll_s)
            return all(p.poll() is not None for p in procs) or any(p.poll() not in (None, 0) for p in procs)

        stop.wait_until(ended, f"the {world} conversion ranks")
    finally:
        stopped = {rank for rank, p in enumerate(procs) if p.poll() is None}
        for rank in stopped:
            procs[rank].kill()
        codes = [p.wait() for p in procs]
        for log in filter(None, logs):
            log.close()
    return [None if rank in stopped else code for rank, code in enumerate(codes)]
