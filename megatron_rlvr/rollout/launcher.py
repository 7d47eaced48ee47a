"""Starting and stopping engine server processes: the CPU engine, or SGLang on GPU machines.
Both are HTTP servers on a port; both are waited for through /health and stopped by pid."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from megatron_rlvr.config import CpuEngine, SglangEngine


class EngineStartError(RuntimeError):
    pass


@dataclass
class ServerProcess:
    command: list[str]
    host: str
    port: int
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)
    stopping: bool = field(default=False, repr=False)  # stop() was called: start() gives up
    closed: bool = field(default=False, repr=False)  # close() was called: start() refuses
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, ready_timeout_s: float = 300.0) -> ServerProcess:
        """Starts the server and waits until it answers /health. stop() from another thread
        ends the wait (the server is stopped, EngineStartError raised)."""
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with self._lock:
            if self.closed:
                raise EngineStartError(f"engine on port {self.port} was closed before it started")
            self.stopping = False
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.stopping:
                raise EngineStartError(f"engine on port {self.port} was stopped while starting")
            if self.proc.poll() is not None:
                raise EngineStartError(f"engine on port {self.port} exited with {self.proc.returncode}; "
                                       f"log: {self.log_path}\n{_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise EngineStartError(f"engine on port {self.port} not healthy after {ready_timeout_s:.0f}s; "
                               f"log: {self.log_path}")

    def close(self, grace_s: float = 10.0) -> None:
        """stop() for good: a start() racing with it refuses instead of starting a server
        nobody will stop."""
        with self._lock:
            self.closed = True
        self.stop(grace_s)

    def exit_description(self) -> str:
        """How the process ended: its exit code, or the signal that killed it."""
        code = self.proc.returncode if self.proc is not None else None
        if code is None:
            return "is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 8) -> str:
        return "\n".join(_tail(self.log_path).splitlines()[-lines:])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """Stops the server and anything it started (its own process group): SIGTERM, then
        SIGKILL after grace_s (at once with 0)."""
        with self._lock:
            self.stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def cpu_engine_command(model_dir: str, engine: CpuEngine, host: str, port: int,
                       routed_experts: bool) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_rlvr.rollout.server", "--model-path", model_dir,
           "--host", host, "--port", str(port), "--dtype", engine.dtype]
    return cmd + (["--enable-return-routed-experts"] if routed_experts else [])


def sglang_command(model_dir: str, engine: SglangEngine, host: str, port: int,
                   routed_experts: bool) -> list[str]:
    """`python -m sglang.launch_server` with the run's layout; SGLang is an optional extra."""
    if importlib.util.find_spec("sglang") is None:
        raise EngineStartError("rollout.engine.type = sglang needs SGLang: "
                               'pip install -c constraints.txt -e ".[gpu]" on a GPU machine')
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir,
           "--host", host, "--port", str(port), "--tp-size", str(engine.tp),
           "--ep-size", str(engine.ep), "--mem-fraction-static", str(engine.mem_fraction_static),
           "--dtype", engine.dtype,
           "--weight-version", "0"]  # SGLang starts at "default"; syncs count from 0
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + list(engine.extra_args)


def engine_process(model_dir: str, engine: CpuEngine | SglangEngine, *, host: str, port: int,
                   routed_experts: bool, log_dir: str | Path) -> ServerProcess:
    build = cpu_engine_command if isinstance(engine, CpuEngine) else sglang_command
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    return ServerProcess(build(model_dir, engine, host, port, routed_experts), host, port,
                         log_dir / f"engine-{port}.log")


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
