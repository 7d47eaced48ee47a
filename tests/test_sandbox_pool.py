"""The sympy worker pool replaces a worker that never says ready, or that dies while a task
is being written to it, within a bound, and never raises to its caller."""

from __future__ import annotations

import subprocess
import sys
import time

from megatron_rlvr.rewards.sandbox import SandboxPool

NEVER_READY = "import time; time.sleep(600)"
# says ready, then closes its end of the pipe the task comes through
DIES_ON_WRITE = "import os, sys, time; print('{\"ready\": true}', flush=True); os.close(0); time.sleep(600)"


class ScriptedPool(SandboxPool):
    """Starts the given stand-in scripts first, then real workers."""

    def __init__(self, scripts: list[str], **kwargs):
        super().__init__(num_workers=1, **kwargs)
        self.scripts = list(scripts)
        self.started = 0

    def _start_process(self) -> subprocess.Popen:
        self.started += 1
        if self.scripts:
            return subprocess.Popen(
                [sys.executable, "-c", self.scripts.pop(0)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        return super()._start_process()


def test_a_worker_that_never_says_ready_is_replaced_within_the_start_bound():
    pool = ScriptedPool([NEVER_READY], start_timeout_s=1.0)
    try:
        started = time.monotonic()
        verdicts = pool.compare([("3", "3"), ("1/2", "3/4")], timeout_s=10.0)
        assert [equal for equal, _ in verdicts] == [True, False]
        assert time.monotonic() - started < 60  # not the hung worker's 600 s
        assert pool.started == 2
    finally:
        pool.close()


def test_workers_that_never_start_end_in_a_verdict_not_a_hang():
    pool = ScriptedPool([NEVER_READY] * 3, start_timeout_s=0.5)
    try:
        assert pool.compare([("3", "3")], timeout_s=10.0) == [(False, "sandbox_unavailable")]
    finally:
        pool.close()


def test_a_worker_that_dies_while_its_task_is_written_loses_no_task():
    pool = ScriptedPool([DIES_ON_WRITE])
    try:
        verdicts = pool.compare([("3", "3"), ("4", "5")], timeout_s=10.0)
        assert [equal for equal, _ in verdicts] == [True, False]
        assert "worker_died" not in [reason for _, reason in verdicts]
        assert pool.started == 2
    finally:
        pool.close()


def test_a_task_whose_workers_keep_dying_on_write_is_scored_not_raised():
    pool = ScriptedPool([DIES_ON_WRITE] * 4)
    try:
        assert pool.compare([("3", "3")], timeout_s=10.0) == [(False, "worker_died")]
    finally:
        pool.close()
