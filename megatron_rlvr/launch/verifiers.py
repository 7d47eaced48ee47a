"""The verifier worker pool that scores every response: the math verifier's sandboxed
processes under this process (local runs), or Ray actors, each with its own sandbox, that
take groups in turn."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter

from megatron_rlvr.config import Config
from megatron_rlvr.launch.cluster import call_all
from megatron_rlvr.rewards.math import MathVerifier


class VerifierWorker:
    def __init__(self, timeout_s: float, num_workers: int = 1):
        self.verifier = MathVerifier(timeout_s=timeout_s, num_workers=num_workers)
        self._lock = threading.Lock()  # scoring runs on worker threads in local runs
        self._reasons: Counter[str] = Counter()

    def rewards(self, responses: list[str], golds: list[str]) -> list[float]:
        verdicts = self.verifier.verify_batch(responses, golds)
        with self._lock:
            self._reasons.update(reason for _, reason in verdicts)
        return [reward for reward, _ in verdicts]

    def take_reasons(self) -> dict[str, int]:
        with self._lock:
            reasons, self._reasons = dict(self._reasons), Counter()
        return reasons

    def close(self) -> None:
        self.verifier.close()


class VerifierPool:
    def __init__(self, cfg: Config, *, remote: bool):
        v = cfg.verifier
        self.remote = remote
        if remote:
            import ray

            actor = ray.remote(VerifierWorker).options(num_cpus=0.01)
            self.workers = [actor.remote(v.timeout_s) for _ in range(v.num_workers)]
        else:
            self.workers = [VerifierWorker(v.timeout_s, v.num_workers)]
        self._turn = itertools.cycle(self.workers)

    async def __call__(self, responses: list[str], golds: list[str]) -> list[float]:
        worker = next(self._turn)
        if self.remote:
            return await worker.rewards.remote(responses, golds)
        return await asyncio.to_thread(worker.rewards, responses, golds)

    def take_reasons(self) -> dict[str, int]:
        """Verdicts of each kind (numeric_equal, timeout, parse_error, ...) since the last call."""
        per_worker = call_all(self.workers, "take_reasons", remote=self.remote)
        return dict(sum((Counter(c) for c in per_worker), Counter()))

    def close(self) -> None:
        if not self.remote:
            for worker in self.workers:
                worker.close()
            return
        import ray

        ray.wait([w.close.remote() for w in self.workers], num_returns=len(self.workers), timeout=30)
        for worker in self.workers:
            ray.kill(worker)
