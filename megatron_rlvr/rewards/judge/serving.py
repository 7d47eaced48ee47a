"""The judge served by the run: one engine server of rollout.engine's kind (the CPU engine or
SGLang), started by the rollout engines' launcher with the run's key, on the judge's model.
It never joins the weight-sync group, so its weights are the checkpoint's for the whole run."""

from __future__ import annotations

from megatron_rlvr.config import CpuEngine, SglangEngine
from megatron_rlvr.config.judge import JudgeConfig
from megatron_rlvr.rewards.judge.client import JudgeEndpoint
from megatron_rlvr.rollout.launcher import ServerProcess, engine_process


class JudgeHost:
    """Owns the judge's server where the run's placement puts this host; the server dies with it."""

    def __init__(
        self, judge: JudgeConfig, engine: CpuEngine | SglangEngine, *, bind: str, log_dir: str, api_key: str | None
    ):
        self.judge, self.engine, self.bind, self.log_dir, self.api_key = judge, engine, bind, log_dir, api_key
        self.server: ServerProcess | None = None

    def start(self) -> JudgeEndpoint:
        from megatron_rlvr.launch.cluster import node_ip
        from megatron_rlvr.learner.parallel import free_port

        assert self.judge.model_path is not None, "a served judge has a model_path (checked by the config)"
        self.server = engine_process(
            self.judge.model_path,
            self.engine,
            host=self.bind,
            port=free_port("" if self.bind == "0.0.0.0" else self.bind),
            routed_experts=False,
            log_dir=self.log_dir,
            name=f"judge engine ({self.engine.type})",
            gpus=self.judge.gpus,
            api_key=self.api_key,
            chat=True,
        )
        self.server.start(self.judge.start_timeout_s)
        host = node_ip() if self.bind == "0.0.0.0" else self.bind
        return JudgeEndpoint(f"http://{host}:{self.server.port}/v1", self.judge.model_path, self.api_key)

    def stop(self, graceful: bool = True) -> None:
        if self.server is not None:
            self.server.close(grace_s=10.0 if graceful else 0.0)

    def close(self) -> None:
        self.stop()
