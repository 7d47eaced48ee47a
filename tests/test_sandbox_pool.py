"""The verdict worker pool replaces a worker that never says ready, or that dies while a task
is being written to it, within a bound, and never raises to its caller."""

from __future__ import annotations

import subprocess
import sys
import time

from megatron_rlvr.rewards.math.workers import SandboxPool, _Worker

NEVER_READY = "import time; time.sleep(600)"
# closes its end of the pipe the task comes through, then says ready: the parent's write of a
# task fails every time (closing after "ready" raced the parent's write, which then landed in
# the pipe and waited out the task's timeout instead)
DIES_ON_WRITE = "import os, sys, time; os.close(0); print('{\"ready\": true}', flush=True); time.sleep(600)"


class ScriptedPool(SandboxPool):
    """Starts the given stand-in scripts first, then real workers. A stand-in that never says
    ready is given up on after `stand_in_start_s`; real workers get the pool's own start bound
    (importing sympy on a loaded 2-core machine can take longer than a stand-in's second)."""

    def __init__(self, scripts: list[str], stand_in_start_s: float = 1.0):
        super().__init__(num_workers=1)
        self.scripts = list(scripts)
        self.stand_in_start_s = stand_in_start_s
        self.started = 0

    def _spawn(self) -> _Worker:
        self.started += 1
        if not self.scripts:
            return super()._spawn()
        proc = subprocess.Popen(
            [sys.executable, "-c", self.scripts.pop(0)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        return _Worker(proc, start_deadline=time.monotonic() + self.stand_in_start_s)


def test_a_worker_that_never_says_ready_is_replaced_within_the_start_bound():
    pool = ScriptedPool([NEVER_READY])
    try:
        verdicts = pool.verdicts([("\\boxed{3}", "3"), ("\\boxed{1/2}", "3/4")], timeout_s=10.0)
        assert [reward for reward, _ in verdicts] == [1.0, 0.0]  # answered, not timed out
        assert pool.started == 2  # by the replacement of the worker that never said ready
    finally:
        pool.close()


def test_workers_that_never_start_end_in_a_verdict_not_a_hang():
    pool = ScriptedPool([NEVER_READY] * 3, stand_in_start_s=0.5)
    try:
        assert pool.verdicts([("\\boxed{3}", "3")], timeout_s=10.0) == [(0.0, "sandbox_unavailable")]
    finally:
        pool.close()


def test_a_worker_that_dies_while_its_task_is_written_loses_no_task():
    pool = ScriptedPool([DIES_ON_WRITE])
    try:
        verdicts = pool.verdicts([("\\boxed{3}", "3"), ("\\boxed{4}", "5")], timeout_s=10.0)
        assert [reward for reward, _ in verdicts] == [1.0, 0.0]
        assert "worker_died" not in [reason for _, reason in verdicts]
        assert pool.started == 2
    finally:
        pool.close()


def test_a_task_whose_workers_keep_dying_on_write_is_scored_not_raised():
    pool = ScriptedPool([DIES_ON_WRITE] * 4)
    try:
        assert pool.verdicts([("\\boxed{3}", "3")], timeout_s=10.0) == [(0.0, "worker_died")]
    finally:
        pool.close()
