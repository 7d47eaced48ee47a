"""The verifier workers that score every response: a run's verifiers (math, code, the user's
functions) under this process (local runs), or Ray actors, each with its own sandboxes, that
take groups in turn."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

from megatron_rlvr.config import Config, VerifierConfig
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.launch.cluster import call_all
from megatron_rlvr.rewards.custom import resolve_function
from megatron_rlvr.rewards.registry import VerdictStats, Verifiers


class VerifierWorker:
    def __init__(self, cfg: VerifierConfig, functions: dict[str, dict], parallel: int = 1):
        self.verifiers = Verifiers(cfg, functions, parallel)
        self._lock = threading.Lock()  # scoring runs on worker threads in local runs
        self._stats = VerdictStats()

    def rewards(self, responses: list[str], record: PromptRecord, count: bool = True) -> list[float]:
        """count=False (evaluation) leaves the training metrics alone."""
        verdicts = self.verifiers.verify(responses, record)
        if count:
            with self._lock:
                self._stats.add(record.verifier, verdicts)
        return [reward for reward, _ in verdicts]

    def take_stats(self) -> VerdictStats:
        with self._lock:
            stats, self._stats = self._stats, VerdictStats()
        return stats

    def close(self) -> None:
        self.verifiers.close()


class VerifierPool:
    def __init__(self, cfg: Config, *, remote: bool):
        v = cfg.verifier
        self.remote = remote
        functions = {name: resolve_function(spec, os.getcwd()) for name, spec in v.functions.items()}
        if remote:
            import ray

            actor = ray.remote(VerifierWorker).options(num_cpus=0.01)
            self.workers = [actor.remote(v, functions) for _ in range(v.num_workers)]
        else:
            self.workers = [VerifierWorker(v, functions, v.num_workers)]
        self._turn = itertools.cycle(self.workers)

    async def __call__(self, responses: list[str], record: PromptRecord, *, count: bool = True) -> list[float]:
        worker = next(self._turn)
        if self.remote:
            return await worker.rewards.remote(responses, record, count)
        return await asyncio.to_thread(worker.rewards, responses, record, count)

    def take_metrics(self) -> dict[str, float]:
        """`verifier/<reason>` counts (numeric_equal, timeout, wrong_answer, ...) and, per
        verifier, `verifier/<name>/samples`, `/reward_mean` and `/<reason>`, since the last call."""
        stats = VerdictStats()
        for part in call_all(self.workers, "take_stats", remote=self.remote):
            stats.merge(part)
        return stats.metrics()

    def close(self) -> None:
        if not self.remote:
            for worker in self.workers:
                worker.close()
            return
        import ray

        ray.wait([w.close.remote() for w in self.workers], num_returns=len(self.workers), timeout=30)
        for worker in self.workers:
            ray.kill(worker)
