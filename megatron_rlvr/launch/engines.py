"""Rollout engine servers, each owned by an EngineHost that starts, restarts and stops it
where the run's placement puts the host (this process, or a Ray actor on some node), so the
server runs there and dies with its owner."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlvr.config import ResolvedConfig
from megatron_rlvr.launch.cluster import node_ip
from megatron_rlvr.launch.placement import Placement, Role
from megatron_rlvr.stopping import StopSignals

if TYPE_CHECKING:
    from megatron_rlvr.rollout.launcher import ServerProcess


def colocated_engine(cfg: ResolvedConfig):
    """rollout.engine, with SGLang's memory saver on where colocated engines release GPU
    memory (launch.colocation; torch_memory_saver is CUDA-only)."""
    engine = cfg.rollout.engine
    if cfg.launch.colocation.enabled and engine.type == "sglang" and engine.device == "cuda":
        return engine.model_copy(update={"extra_args": ["--enable-memory-saver", *engine.extra_args]})
    return engine


class EngineHost:
    def __init__(
        self,
        cfg: ResolvedConfig,
        model_dir: str,
        log_dir: str,
        index: int = 0,
        gpus: list[int] | None = None,
        api_key: str | None = None,
        cpus: list[int] | None = None,
    ):
        """gpus: the GPU ids the server may see (None: as the process environment says);
        api_key: the run's key, which every request but /health must carry; cpus: the cores
        the server runs on (None: any)."""
        self.cfg, self.model_dir, self.log_dir, self.index, self.gpus = cfg, model_dir, log_dir, index, gpus
        self.api_key, self.cpus = api_key, cpus
        self.server: ServerProcess | None = None
        self.closed = False  # stop() came (perhaps while start() was on its way)

    def start(self) -> str:
        """Starts the server on a free port; returns the URL the rollout manager uses."""
        from megatron_rlvr.learner.parallel import free_port
        from megatron_rlvr.rollout.launcher import EngineStartError, engine_process

        rollout = self.cfg.rollout
        bind = rollout.host
        self.server = server = engine_process(
            self.model_dir,
            colocated_engine(self.cfg),
            host=bind,
            port=free_port("" if bind == "0.0.0.0" else bind),
            routed_experts=rollout.return_routed_experts,
            log_dir=self.log_dir,
            name=f"engine {self.index} ({rollout.engine.type})",
            gpus=self.gpus,
            api_key=self.api_key,
            in_flight=rollout.updates == "in_flight",
            cpus=self.cpus,
        )
        if self.closed:
            raise EngineStartError("the run stopped before this engine started")
        server.start(rollout.start_timeout_s)
        host = node_ip() if bind == "0.0.0.0" else bind
        return f"http://{host}:{server.port}"

    def restart(self) -> str | None:
        """Same port, fresh process, if the server died or hangs: it comes back with the
        initial weights (version 0). Returns how the old one ended and the last lines of its
        log, for the run's log; None when the server still answers (slow under load, not
        dead) and is left alone."""
        import subprocess

        import httpx

        from megatron_rlvr.rollout.client import auth_headers

        server = self.server
        assert server is not None and server.proc is not None, "restart() follows start()"
        try:
            server.proc.wait(timeout=5)  # a killed server may take a moment to be reaped
            how = server.exit_description()
        except subprocess.TimeoutExpired:
            try:
                if httpx.get(f"{server.url}/health", timeout=30, headers=auth_headers(self.api_key)).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            how = "hung (no answer to /health within 30 s) and was stopped"
        server.stop()  # what is left of the old one too (SGLang's scheduler processes)
        report = f"{how}; the end of its log ({server.log_path}):\n{server.log_tail(lines=8)}"
        server.start(self.cfg.rollout.start_timeout_s)
        return report

    def stop(self, graceful: bool = True) -> None:
        self.closed = True
        if self.server is not None:
            self.server.close(grace_s=10.0 if graceful else 0.0)


class EngineFleet:
    """All engines of a run; start() brings them up in parallel and stops all if one fails."""

    def __init__(self, cfg: ResolvedConfig, model_dir: Path, placement: Placement, api_key: str | None = None):
        log_dir = str(Path(cfg.trainer.output_dir) / "logs")
        self.hosts = [
            placement.place(
                Role.ENGINE,
                EngineHost,
                cfg,
                str(model_dir),
                log_dir,
                i,
                placement.engine_gpus(i),
                api_key,
                placement.engine_cpus(i),
                index=i,
            )
            for i in range(cfg.rollout.num_engines)
        ]
        self.urls: list[str] = []

    def _call(self, index: int, method: str, *args):
        return self.hosts[index].call(method, *args)

    def start(self, stop: StopSignals) -> list[str]:
        """Starts every engine at once; a stop request or one engine's failure stops them all."""
        urls: list = [None] * len(self.hosts)
        errors: list[BaseException] = []

        def start_one(i: int) -> None:
            try:
                urls[i] = self._call(i, "start")
            except BaseException as err:  # reported below, after every start attempt finished
                errors.append(err)

        threads = [threading.Thread(target=start_one, args=(i,), daemon=True) for i in range(len(self.hosts))]
        for t in threads:
            t.start()
        try:
            for t in threads:
                stop.wait_until(functools.partial(_joined, t), "the engines to start")
        except BaseException:
            self.stop(graceful=False)
            raise
        if errors:
            self.stop()
            raise errors[0]
        self.urls = urls
        return urls

    def restart(self, index: int) -> str | None:
        return self._call(index, "restart")

    def stop(self, graceful: bool = True) -> None:
        for index in range(len(self.hosts)):
            try:
                self._call(index, "stop", graceful)
            except Exception:  # a host that is gone took its server with it
                pass


def _joined(thread: threading.Thread, timeout_s: float) -> bool:
    thread.join(timeout_s)
    return not thread.is_alive()
