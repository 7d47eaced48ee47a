"""Starting and stopping engine server processes: the CPU engine, or SGLang (on GPUs, or on CPU
from its own interpreter). Both are HTTP servers on a port, waited for through /health and
stopped by process group. A watchdog process stops a server whose owner died without
stopping it, so a crashed run never leaves a server holding GPUs or cores.

Each server gets the run's API key off its command line (`ps` shows argv): the CPU engine in
its environment, SGLang in a --config file readable by this user only, there while it starts.
SGLang 0.5.23 logs its arguments, the key among them, so a keyed server's output reaches its
log through a copy that blanks the key."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from megatron_rlvr.config import CpuEngine, SglangEngine
from megatron_rlvr.errors import UserError
from megatron_rlvr.rollout.client import ENGINE_API_KEY_ENV, auth_headers

log = logging.getLogger(__name__)

# SGLang on CPU (0.5.23), each setting for a reason:
#   SGLANG_USE_CPU_ENGINE=1   selects its CPU platform; --device cpu alone is not enough.
#   torch_native attention, pytorch sampling: the plain-torch paths (no Triton/FlashInfer).
#   --disable-cuda-graph      no graph capture.
#   --sleep-on-idle           otherwise the idle scheduler busy-polls a whole core.
#   --max-total-tokens 65536  otherwise the KV pool is sized from free RAM (15 GB on a 24 GiB box
#                             for the tiny model, 17 s of start-up); extra_args can raise it.
SGLANG_CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--sleep-on-idle",
    "--max-total-tokens",
    "65536",
]
PROGRESS_EVERY_S = 30.0
# Log lines after which a server never becomes healthy although its process lives on (SGLang
# 0.5.23 keeps running when uvicorn cannot bind its port).
FATAL_LOG_LINES = ("error while attempting to bind",)


class EngineStartError(UserError):
    """An engine server that could not start: one line naming the engine, why, and its log."""


@dataclass
class ServerProcess:
    command: list[str]
    host: str
    port: int
    log_path: Path
    name: str = "engine"
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment; never the key
    check_port: bool = True  # refuse at once when the port is taken
    api_key: str | None = field(default=None, repr=False)  # the run's key: health checks send it, logs never show it
    key_env: str | None = None  # the variable that hands the key to the server (the CPU engine), added at start
    key_file: Path | None = None  # SGLang's --config file holding the key, written for each start, removed after
    cpus: list[int] | None = None  # the cores the server and every process it starts run on; None: any
    proc: subprocess.Popen | None = field(default=None, repr=False)
    watchdog: subprocess.Popen | None = field(default=None, repr=False)
    log_copy: threading.Thread | None = field(default=None, repr=False)  # a keyed server's output → its log
    stopping: bool = field(default=False, repr=False)  # stop() was called: start() gives up
    closed: bool = field(default=False, repr=False)  # close() was called: start() refuses
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, ready_timeout_s: float = 600.0) -> ServerProcess:
        """Starts the server in a session of its own, with a watchdog that stops that session if
        this process dies; waits for /health, logging progress. On failure nothing is left running.
        stop() from another thread ends the wait (the server is stopped, EngineStartError raised)."""
        if self.check_port and not port_free(self.host, self.port):
            raise EngineStartError(
                f"{self.name} ({self.url}) cannot start: port {self.port} is in use; log: {self.log_path}"
            )
        threads = str(len(self.cpus)) if self.cpus else os.environ.get("OMP_NUM_THREADS", "1")
        env = {**os.environ, "OMP_NUM_THREADS": threads, **self.env}
        if self.key_env is not None and self.api_key:
            env[self.key_env] = self.api_key
        try:
            with self._lock:
                if self.closed:
                    raise EngineStartError(f"{self.name} ({self.url}) was closed before it started")
                self.stopping = False
                log_start = self._spawn(env)
            return self._wait_ready(ready_timeout_s, log_start)
        finally:  # on every path: the server has read it as it started, or never will
            if self.key_file is not None:
                self.key_file.unlink(missing_ok=True)

    def _spawn(self, env: dict[str, str]) -> int:
        """The server (its key file written first), pinned to its cores, its redacted log copy and
        its watchdog; returns where this start's lines begin in the log."""
        if self.key_file is not None and self.api_key:
            write_private(self.key_file, f"api-key: {self.api_key}\n")
        with open(self.log_path, "ab") as out:
            log_start = out.tell()  # a restart appends: only this start's lines count
            self.proc = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE if self.api_key else out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if self.cpus:  # before the server starts threads or processes, which inherit its cores
            try:
                pin_process(self.proc.pid, self.cpus, f"{self.name} ({self.url})")
            except UserError:
                self.proc.kill()
                self.proc.communicate()
                raise
        if self.api_key:
            assert self.proc.stdout is not None
            copy = (self.proc.stdout, self.log_path, self.api_key)
            self.log_copy = threading.Thread(target=copy_redacted, args=copy, daemon=True, name=f"{self.name} log")
            self.log_copy.start()
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "megatron_rlvr.rollout.watchdog", str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return log_start

    def _wait_ready(self, ready_timeout_s: float, log_start: int) -> ServerProcess:
        assert self.proc is not None
        started = time.monotonic()
        next_report = started + PROGRESS_EVERY_S
        while True:
            waited = time.monotonic() - started
            if self.stopping:
                raise EngineStartError(f"{self.name} ({self.url}) was stopped while starting")
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise EngineStartError(
                    f"{self.name} ({self.url}) exited with {code} before it was ready: "
                    f"{failure_reason(self.log_path)}; log: {self.log_path}"
                )
            fatal = fatal_line(self.log_path, log_start)
            if fatal is not None:
                self.stop()
                raise EngineStartError(f"{self.name} ({self.url}) failed to start: {fatal}; log: {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0, headers=auth_headers(self.api_key)).status_code == 200:
                    log.info("%s ready at %s after %.0f s", self.name, self.url, waited)
                    return self
            except httpx.HTTPError:
                pass
            if waited > ready_timeout_s:
                self.stop()
                raise EngineStartError(
                    f"{self.name} ({self.url}) not healthy after {ready_timeout_s:.0f} s "
                    f"(rollout.start_timeout_s); last log line: {last_line(self.log_path)}; "
                    f"log: {self.log_path}"
                )
            if time.monotonic() >= next_report:
                log.info(
                    "%s: waiting for %s/health, %.0f s of %.0f s; log: %s; last line: %s",
                    self.name,
                    self.url,
                    waited,
                    ready_timeout_s,
                    self.log_path,
                    last_line(self.log_path),
                )
                next_report += PROGRESS_EVERY_S
            time.sleep(0.25)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """Stops the server and everything it started (its session's process group, what is
        left of it after the server itself died included): SIGTERM, then SIGKILL after grace_s
        (at once with 0)."""
        with self._lock:
            self.stopping = True
        if self.proc is not None:
            stop_group(self.proc.pid, grace_s, wait=self.proc.wait)
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        if self.log_copy is not None:
            self.log_copy.join(timeout=5.0)  # its last lines, which say why it ended, in the log

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


def pin_process(pid: int, cores: list[int], what: str) -> None:
    """Every thread of process `pid` onto `cores` (threads and processes it starts later
    inherit them); one line naming `what` when this machine has not got them. A thread that
    ends between the listing and its pinning needs none (a long-lived process, such as a
    benchmark running several runs, has short-lived threads)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:
                continue
    except OSError as err:
        raise UserError(
            f"{what} cannot be pinned to cores {cores}: {err.strerror} (this machine has {os.cpu_count()} cores)"
        ) from None


def write_private(path: Path, text: str) -> None:
    """A file only this user can read (created so: never readable by others, not even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def copy_redacted(stream, log_path: Path, secret: str) -> None:
    """A server's output into its log, line by line, with `secret` blanked; ends when the
    server and every process it started have closed their output."""
    with stream, open(log_path, "ab") as out:
        for line in stream:
            out.write(line.replace(secret.encode(), b"<api-key>"))
            out.flush()


def stop_group(pgid: int, grace_s: float, wait=None) -> None:
    """SIGTERM to a process group, SIGKILL to whatever is left of it after grace_s."""
    try:
        os.killpg(pgid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    if wait is not None:
        try:
            wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if wait is not None:
        wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def fatal_line(path: Path, since: int = 0) -> str | None:
    """The first FATAL_LOG_LINES line written after byte `since`, if any."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if any(pattern in line for pattern in FATAL_LOG_LINES):
            return line.strip()[:300]
    return None


def last_line(path: Path) -> str:
    lines = [line.strip() for line in _tail(path).splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(empty)"


def failure_reason(path: Path) -> str:
    """The line of a server's log that says why it stopped: an argparse error, the last
    exception, or else its last line."""
    lines = [line.strip() for line in _tail(path, 20000).splitlines() if line.strip()]
    for pattern in (r"\berror: ", r"^[A-Za-z_.]*(Error|Exception)\b.*:", r"(Error|Exception): "):
        hits = [line for line in lines if re.search(pattern, line)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "(empty log)"


def cpu_engine_command(
    model_dir: str, engine: CpuEngine, host: str, port: int, routed_experts: bool, threads: int = 1
) -> list[str]:
    """threads: torch's, one per core the engine is pinned to (1 unpinned: it shares the
    machine with the learner)."""
    cmd = [
        sys.executable,
        "-m",
        "megatron_rlvr.rollout.server",
        "--model-path",
        model_dir,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        engine.dtype,
        "--threads",
        str(threads),
    ]
    return cmd + (["--enable-return-routed-experts"] if routed_experts else [])


def sglang_command(
    model_dir: str,
    engine: SglangEngine,
    host: str,
    port: int,
    routed_experts: bool,
    in_flight: bool = False,
    chat: bool = False,
) -> list[str]:
    """`python -m sglang.launch_server` with the run's layout. Requests and responses carry
    token ids only (the sampler tokenizes), so SGLang skips its tokenizer, except for a server
    that answers chat requests (chat: a judge's). in_flight (syncs
    that land mid-sequence): without the overlap scheduler, whose forward queued at a pause
    puts one old-weights token in the new version's span (docs/in-flight.md), so every
    token's version tag is exact."""
    python = engine.python or sys.executable
    if engine.python is None and importlib.util.find_spec("sglang") is None:
        raise EngineStartError(
            "rollout.engine.type = sglang needs SGLang: bash scripts/setup.sh --gpu on a "
            "GPU machine, or set rollout.engine.python to an interpreter that has it"
        )
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_dir,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(engine.tp),
        "--ep-size",
        str(engine.ep),
        "--mem-fraction-static",
        str(engine.mem_fraction_static),
        "--dtype",
        engine.dtype,
        *([] if chat else ["--skip-tokenizer-init"]),
        "--weight-version",
        "0",
    ]  # SGLang starts at "default"; syncs count from 0
    if engine.device == "cpu":
        cmd += SGLANG_CPU_FLAGS
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    if in_flight:
        cmd.append("--disable-overlap-schedule")
    return cmd + list(engine.extra_args)  # last: argparse lets a later flag override ours


def sglang_env(engine: SglangEngine, gpus: list[int] | None = None, cpus: list[int] | None = None) -> dict[str, str]:
    """CPU: the CPU platform, and one core set per TP rank out of `cpus` (None: this process's
    cores; SGLang's default binds a rank per NUMA node and refuses more ranks than nodes).
    CUDA: the engine's GPUs, when given."""
    if engine.device == "cuda":
        return {} if gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_binding(cpus or sorted(os.sched_getaffinity(0)), engine.tp)
    return env


def cpu_binding(cores: list[int], ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks: contiguous core ranges, one per rank
    ("0-7|8-15"); with fewer cores than ranks, ranks share cores round-robin ("0|1|0")."""
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    per = len(cores) // ranks
    chunks = [cores[r * per : (r + 1) * per] for r in range(ranks)]
    return "|".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in chunks)


def engine_process(
    model_dir: str,
    engine: CpuEngine | SglangEngine,
    *,
    host: str,
    port: int,
    routed_experts: bool,
    log_dir: str | Path,
    name: str = "engine",
    gpus: list[int] | None = None,
    api_key: str | None = None,
    in_flight: bool = False,
    cpus: list[int] | None = None,
    chat: bool = False,
) -> ServerProcess:
    """chat: it answers /v1/chat/completions (a judge: SGLang then loads its tokenizer).
    gpus: the GPU ids this engine may see (launch.mode = local; Ray sets them for actors).
    api_key: what every request but /health must carry (None: the server checks nothing).
    in_flight: the run's syncs land mid-sequence (rollout.updates = in_flight).
    cpus: the cores the server runs on (launch.engine_cpus' share; None: any)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    key_file, key_env = None, None
    if isinstance(engine, CpuEngine):
        command = cpu_engine_command(model_dir, engine, host, port, routed_experts, len(cpus) if cpus else 1)
        env: dict[str, str] = {}
        key_env = ENGINE_API_KEY_ENV
    else:
        command = sglang_command(model_dir, engine, host, port, routed_experts, in_flight, chat)
        env = sglang_env(engine, gpus, cpus)
        if api_key:  # SGLang reads no key from its environment: a --config file, not argv
            key_file = log_dir / f"engine-{port}.key.yaml"
            command += ["--config", str(key_file)]
    log_path = log_dir / f"engine-{port}.log"
    return ServerProcess(
        command,
        host,
        port,
        log_path,
        name=name,
        env=env,
        api_key=api_key,
        key_env=key_env,
        key_file=key_file,
        cpus=cpus,
    )


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
