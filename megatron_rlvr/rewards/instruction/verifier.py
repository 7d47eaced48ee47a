"""The `ifeval` verifier on the parent side. Responses are scored by checkers.score in the
sandbox, as users' functions are (one confined child per response, with the verifier's time and
memory limits), by a supervisor (worker.py) that is started on first use and kept, so that the
checkers are loaded once, not once per group. A checker that raises, runs out of time or memory
is a 0 with that reason (runtime_error, timeout, memory), counted in the run's metrics; a
supervisor that dies or stops answering is killed and started afresh for the next batch."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.rewards.reasoning import strip_reasoning
from megatron_rlvr.rewards.verdict import Verdict

START_TIMEOUT_S = 60.0  # loading the checkers (a supervisor that has not said ready by then is replaced)
REPLY_SLACK_S = 5.0  # a reply's allowance beyond its child's wall-time limit (fork, reaping)


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """What the checkers that compare with the prompt see: the last user message."""
    if isinstance(prompt, str):
        return prompt
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


def _verdict(outcome: dict) -> Verdict:
    status = outcome.get("status", "sandbox_error")
    if status != "scored":
        return 0.0, status
    value = outcome["value"]
    return value, "all_followed" if value == 1.0 else "partly_followed" if value > 0.0 else "not_followed"


class _Supervisor:
    """One worker.py process and its directory; replies read line by line with deadlines."""

    def __init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="rlvr-ifeval-")
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        # TMPDIR: its NLTK data directory is made in its own directory, removed with it however it ends
        env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0", TMPDIR=self.workdir)
        self.proc = subprocess.Popen(
            [sys.executable, "-B", "-P", "-m", "megatron_rlvr.rewards.instruction.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=self.workdir,
            env=env,
            start_new_session=True,
        )
        self.buffer = b""
        self.ready = False

    def send(self, message: dict) -> bool:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            return True
        except OSError:
            return False

    def reply(self, deadline: float) -> dict | None:
        """The next line, or None when the supervisor has ended or the deadline passed."""
        out = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # what a dead supervisor left unread in its pipe
                stream.close()  # type: ignore[union-attr]
        shutil.rmtree(self.workdir, ignore_errors=True)


class IFEvalVerifier:
    """grading: binary or fraction (checkers.score); loose: IFEval's loose reading. Batches
    from several threads take turns at the one supervisor."""

    def __init__(self, *, grading: str, loose: bool, timeout_s: float, memory_mb: int):
        self.scoring = {"grading": grading, "loose": loose}
        self.settings = {"wall_s": timeout_s, "memory_mb": memory_mb, "output_bytes": 1 << 20}
        self._supervisor: _Supervisor | None = None
        self._lock = threading.Lock()

    def verify_batch(self, responses: list[str], record: PromptRecord) -> list[Verdict]:
        task = {"ground_truth": record.answer, "prompt": prompt_text(record.prompt), **self.scoring}
        verdicts: list[Verdict | None] = [
            None if strip_reasoning(r).strip() else (0.0, "no_response") for r in responses
        ]
        todo = [i for i, v in enumerate(verdicts) if v is None]
        if todo:
            with self._lock:
                outcomes = self._run([{"response": responses[i], "record": task} for i in todo])
            for i, outcome in zip(todo, outcomes):
                verdicts[i] = _verdict(outcome)
        return verdicts  # type: ignore[return-value]

    def _run(self, jobs: list[dict]) -> list[dict]:
        """One outcome per job; the supervisor is (re)started as needed and replaced when it
        fails (the jobs it did not answer get the reason)."""
        supervisor = self._supervisor or _Supervisor()
        self._supervisor = supervisor
        if not supervisor.ready:
            supervisor.ready = supervisor.reply(time.monotonic() + START_TIMEOUT_S) == {"ready": True}
            if not supervisor.ready:
                self.close()
                return [{"status": "sandbox_unavailable"}] * len(jobs)
        if not supervisor.send({"settings": self.settings, "jobs": jobs}):
            self.close()
            return [{"status": "sandbox_error"}] * len(jobs)
        outcomes: list[dict] = []
        for _ in jobs:
            answer = supervisor.reply(time.monotonic() + self.settings["wall_s"] + REPLY_SLACK_S)
            if answer is None:
                self.close()
                return outcomes + [{"status": "sandbox_error"}] * (len(jobs) - len(outcomes))
            outcomes.append(answer["outcome"])
        return outcomes

    def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
