"""Math verdicts in killable worker processes.

Model output is untrusted: reading a crafted response, or simplifying a crafted expression (a
power tower, a huge factorial), can take unbounded time and memory. So the whole verdict on a
pair, from finding the final answer to sympy, runs in child processes (`python -m
megatron_rlvr.rewards.math.workers`) with an address-space limit, and a parent that kills a worker
past its per-pair deadline (0.0, `timeout`) and starts a fresh one. Workers parse with the same
bounded parser (math.parse) and build sympy objects by constructor calls: nothing from a
response is ever evaluated as code. The caller never waits longer than the timeout per pair and
never sees an exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from megatron_rlvr.rewards.math.parse import parse_answer
from megatron_rlvr.rewards.math.text import AnswerError
from megatron_rlvr.rewards.math.verdict import prepare
from megatron_rlvr.rewards.verdict import Verdict

MAX_START_FAILURES = 3
# a worker that has not said ready this long after its start is replaced (a hung start-up)
START_TIMEOUT_S = 60.0


# ============================================================================ worker side
def compare_in_worker(pred: str, gold: str) -> tuple[bool, str]:
    """Worker-side verdict on two cleaned answers → (equal, reason). Parsing is repeated here
    (it is cheap) so that only strings cross the pipe."""
    from megatron_rlvr.rewards.math.compare import compare
    from megatron_rlvr.rewards.math.symbolic import SympyBackend

    try:
        equal, reason = compare(parse_answer(pred), parse_answer(gold), SympyBackend())
        return bool(equal), reason
    except AnswerError as err:
        return False, err.reason
    except MemoryError:
        return False, "too_large"
    except RecursionError:
        return False, "too_deep"
    except Exception:
        return False, "sympy_error"


def verdict_in_worker(response: str, gold: str) -> Verdict:
    """The verdict on a raw (response, gold) pair: the in-process checks, then sympy for what
    they leave undecided."""
    prepared = prepare(response, gold)
    if not isinstance(prepared[0], str):
        return prepared
    equal, reason = compare_in_worker(*prepared)
    return (1.0 if equal else 0.0), reason


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """Ends this worker once the process that started it is gone (a killed run or test): its
    deadline is enforced from there, so an orphan computing a runaway verdict would never stop.
    A thread, not PR_SET_PDEATHSIG: that fires when the starting *thread* ends, and pools start
    workers from short-lived threads."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)


def _serve(memory_mb: int) -> None:
    import resource

    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing sympy prints can corrupt the protocol
    compare_in_worker("1", "1")  # import sympy before saying ready
    protocol.write('{"ready": true}\n')
    for line in sys.stdin:
        task = json.loads(line)
        reward, reason = verdict_in_worker(task["response"], task["gold"])
        protocol.write(json.dumps({"reward": reward, "reason": reason}) + "\n")


# ============================================================================ parent side
@dataclass
class _Worker:
    proc: subprocess.Popen
    start_deadline: float
    buffer: bytes = b""
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0
    replies: deque = field(default_factory=deque)

    def read(self) -> bool:
        """Reads what is available; False on EOF (the worker died) or a line outside the protocol."""
        assert self.proc.stdout is not None  # started with stdout=PIPE
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:  # not the protocol: treat the worker as broken
                return False
            if not isinstance(message, dict):
                return False
            if message.get("ready"):
                self.ready = True
            else:
                self.replies.append(message)
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stdin):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a task left unflushed in a dead worker's pipe
                    pipe.close()


class SandboxPool:
    """A fixed number of verdict worker processes, started on first use."""

    def __init__(self, num_workers: int = 2, memory_mb: int = 1024, start_timeout_s: float = START_TIMEOUT_S):
        self.num_workers = num_workers
        self.memory_mb = memory_mb
        self.start_timeout_s = start_timeout_s
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._start_failures = 0  # workers that died before ready, in a row

    def _spawn(self) -> _Worker:
        return _Worker(self._start_process(), start_deadline=time.monotonic() + self.start_timeout_s)

    def _start_process(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME")}
        env["OMP_NUM_THREADS"] = "1"
        return subprocess.Popen(
            [sys.executable, "-m", "megatron_rlvr.rewards.math.workers", str(self.memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def verdicts(self, pairs: list[tuple[str, str]], timeout_s: float) -> list[Verdict]:
        """Verdicts for (response, gold) pairs; each pair gets at most `timeout_s` of a worker's
        time, counted from when a ready worker takes it, and is (0.0, "timeout") past it."""
        with self._lock:
            self._start_failures = 0
            while len(self._workers) < min(self.num_workers, max(1, len(pairs))):
                self._workers.append(self._spawn())
            return self._run(pairs, timeout_s)

    def _run(self, pairs, timeout_s):
        results: list[Verdict | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        retried = [0] * len(pairs)
        with selectors.DefaultSelector() as selector:
            for worker in self._workers:
                selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
            while pending or any(w.task is not None for w in self._workers):
                for worker in list(self._workers):
                    if worker.ready and worker.task is None and pending:
                        index = pending.popleft()
                        response, gold = pairs[index]
                        worker.task, worker.deadline = index, time.monotonic() + timeout_s
                        try:
                            task = json.dumps({"response": response, "gold": gold}) + "\n"
                            worker.proc.stdin.write(task.encode())
                            worker.proc.stdin.flush()
                        except OSError:  # it died before reading the task: another worker takes it, once
                            worker.task = None
                            retried[index] += 1
                            if retried[index] > 1:
                                results[index] = (0.0, "worker_died")
                            else:
                                pending.appendleft(index)
                            self._replace(worker, selector, results, "worker_died")
                now = time.monotonic()
                deadlines = [
                    w.deadline if w.task is not None else w.start_deadline
                    for w in self._workers
                    if not w.ready or w.task is not None
                ]
                wait = max(0.0, min(deadlines) - now) if deadlines else 0.05
                for key, _ in selector.select(timeout=min(wait, 1.0)):
                    worker = key.data
                    if worker not in self._workers:
                        continue  # replaced earlier in this pass
                    alive = worker.read()
                    while worker.replies and worker.task is not None:
                        reply = worker.replies.popleft()
                        results[worker.task] = (float(reply["reward"]), str(reply["reason"]))
                        worker.task = None
                    if not alive:
                        self._replace(worker, selector, results, "worker_died")
                now = time.monotonic()
                for worker in list(self._workers):
                    if worker.task is not None and now >= worker.deadline:
                        self._replace(worker, selector, results, "timeout")
                    elif not worker.ready and now >= worker.start_deadline:
                        self._replace(worker, selector, results, "worker_not_ready")
                if self._start_failures >= MAX_START_FAILURES:
                    # workers cannot even start (broken env, memory limit): fail fast, never spin
                    while pending:
                        results[pending.popleft()] = (0.0, "sandbox_unavailable")
                    if not any(w.task is not None for w in self._workers):
                        break
        return results

    def _replace(self, worker: _Worker, selector, results, reason: str) -> None:
        self._start_failures = 0 if worker.ready else self._start_failures + 1
        if worker.task is not None:
            results[worker.task] = (0.0, reason)
        selector.unregister(worker.proc.stdout)
        worker.kill()
        fresh = self._spawn()
        self._workers[self._workers.index(worker)] = fresh
        selector.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                worker.kill()
            self._workers.clear()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
