"""The verifier workers that score every response: a run's verifiers (math, code, ifeval, the
judge, the user's functions), verifier.num_workers of them placed where the run's placement
puts them, each with its own sandboxes, taking groups in turn; and the judge's engine, when the
run serves it."""

from __future__ import annotations

import itertools
import os
import threading
import time

from megatron_rlvr.config import ResolvedConfig, VerifierConfig
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.launch.placement import Placement, Role, call_all, close_all
from megatron_rlvr.rewards.custom import resolve_function
from megatron_rlvr.rewards.judge.client import JudgeEndpoint, judge_endpoint
from megatron_rlvr.rewards.judge.serving import JudgeHost
from megatron_rlvr.rewards.registry import VerdictStats, Verifiers


class VerifierWorker:
    def __init__(self, cfg: VerifierConfig, functions: dict[str, dict], judge: JudgeEndpoint | None = None):
        self.verifiers = Verifiers(cfg, functions, judge)
        self._lock = threading.Lock()  # scoring runs on worker threads in local runs
        self._stats = VerdictStats()

    def rewards(self, responses: list[str], record: PromptRecord, count: bool = True) -> list[float | None]:
        """count=False (evaluation) leaves the training metrics alone. None: a group the judge
        could not score (dropped by the buffer as unscored)."""
        started = time.perf_counter()
        verdicts = self.verifiers.verify(responses, record)
        if count:
            with self._lock:
                self._stats.add(record.verifier, verdicts, time.perf_counter() - started)
        return [reward for reward, _ in verdicts]

    def take_stats(self) -> VerdictStats:
        with self._lock:
            stats, self._stats = self._stats, VerdictStats()
        if self.verifiers.judge is not None:
            stats.counters.update({f"judge/{k}": n for k, n in self.verifiers.judge.take_counts().items()})
        return stats

    def close(self) -> None:
        self.verifiers.close()


class VerifierPool:
    def __init__(self, cfg: ResolvedConfig, placement: Placement, api_key: str | None = None):
        """api_key: the run's key, which a judge the run serves requires."""
        v = cfg.verifier
        functions = {name: resolve_function(spec, os.getcwd()) for name, spec in v.functions.items()}
        self.judge_host = None
        judge = None
        if v.judge is not None and v.judge.model_path is not None:
            log_dir = os.path.join(cfg.trainer.output_dir, "logs")
            bind = cfg.rollout.host
            self.judge_host = placement.place(
                Role.SERVICE, JudgeHost, v.judge, cfg.rollout.engine, bind=bind, log_dir=log_dir, api_key=api_key
            )
            judge = self.judge_host.call("start")
        elif v.judge is not None:
            judge = judge_endpoint(v.judge)
        self.workers = [
            placement.place(Role.VERIFIER, VerifierWorker, v, functions, judge, index=i) for i in range(v.num_workers)
        ]
        self._turn = itertools.cycle(self.workers)

    async def __call__(self, responses: list[str], record: PromptRecord, *, count: bool = True) -> list[float | None]:
        return await next(self._turn).call_async("rewards", responses, record, count)

    def take_metrics(self) -> dict[str, float]:
        """`verifier/<reason>` counts (numeric_equal, timeout, wrong_answer, ...) and, per
        verifier, `verifier/<name>/samples`, `/reward_mean` and `/<reason>`, since the last call."""
        stats = VerdictStats()
        for part in call_all(self.workers, "take_stats"):
            stats.merge(part)
        return stats.metrics()

    def close(self) -> None:
        close_all(self.workers, grace_s=30.0)
        if self.judge_host is not None:
            close_all([self.judge_host], grace_s=30.0)
