"""The engines' side of a colocated step (launch.colocation), as the learner's source rank
drives it. One step:

    generate → sleep: every engine releases its KV cache, then its weights
    → (the learner takes back its optimizer states and gradients, computes the old logprobs
       and trains, then sets them aside again: learner/offload.py)
    → wake, stage 1: every engine takes back its weights' memory
    → hand-over: the learner's weights in flattened buckets, update_weights_from_tensor
       (one payload per engine TP rank), the engines' prefix cache flushed
    → wake, stage 2: every engine takes back its KV cache → (parity probe) → generate

The wake comes in two stages so that the KV cache is not allocated while the bucket being
handed over still occupies memory (peak = weights + one bucket, not weights + KV + bucket).
Released weights come back as garbage (SGLang without --enable-weights-cpu-backup), which the
hand-over overwrites before anything generates.

Every engine call is bounded (launch.colocation.*_timeout_s): an engine that does not
release, resume or load within its bound ends the run with a ColocationError naming the
engine and what it waited for. A colocated sync restarts no engine and retries nothing: they
share memory with the learner, and an engine stuck half-released holds it.

ColocatedSyncer has the WeightSyncer calls the learner's sync uses (connect, sync,
member_clients, version, close), so learner_sync.sync_weights and its parity probe run
unchanged over it; no update group is formed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from megatron_rlvr.config import ResolvedConfig
from megatron_rlvr.errors import UserError
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.weight_sync.syncer import SyncReport

if TYPE_CHECKING:
    from megatron_rlvr.weight_sync.tensor_handover import HandoverStats

KV_CACHE, WEIGHTS = "kv_cache", "weights"  # SGLang's memory tags (srt/constants.py)


class ColocationError(UserError):
    """An engine that did not release, resume or take a hand-over within its bound."""


MemorySnapshot = Callable[[], dict[str, float]]


class ColocatedSyncer:
    def __init__(
        self,
        clients: list[EngineClient],
        cfg: ResolvedConfig,
        *,
        engine_ranks: list[int] | None = None,
        memory: MemorySnapshot | None = None,
    ):
        """engine_ranks: each engine's TP ranks (one payload each); memory: what a phase
        boundary records (learner/offload.memory_snapshot), None: nothing."""
        self.clients = clients
        self.co = cfg.launch.colocation
        self.bucket_bytes = int(cfg.weight_sync.bucket_mb * 2**20)
        self.device = "cuda" if cfg.parallel.device == "cuda" else "cpu"  # where buckets are packed: IPC on GPU
        self.engine_ranks = engine_ranks or [1] * len(clients)
        self.memory = memory
        self.version: int | None = None
        self.released: dict[int, list[str]] = {}  # engine → the tags it holds released
        self.metrics: dict[str, float] = {}  # the last sleep's and sync's, taken by take_metrics

    @property
    def member_clients(self) -> list[EngineClient]:
        return self.clients

    async def connect(self) -> None:
        """Adopts the engines' weight version; they must agree."""
        versions = {info["weight_version"] for info in await self._each("report its weight version", _model_info)}
        if len(versions) != 1 or not next(iter(versions)).lstrip("-").isdigit():
            raise ColocationError(f"engines report weight versions {sorted(versions)}: they must start from one")
        self.version = int(versions.pop())

    def take_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics

    def mark(self, phase: str) -> None:
        if self.memory is not None:
            self.metrics.update({f"colocate/mem/{phase}/{k}": v for k, v in self.memory().items()})

    # ------------------------------------------------------------------ sleep and wake
    async def sleep(self) -> None:
        """Every engine releases its KV cache, then its weights (nothing is generating: a
        colocated run drains before it trains)."""
        started = time.perf_counter()
        self.mark("before_sleep")
        for tag in (KV_CACHE, WEIGHTS):
            await self._each(
                f"release its {tag}",
                _release(tag, self.co.release_timeout_s),
                self.co.release_timeout_s,
                "release_timeout_s",
            )
            for index in range(len(self.clients)):
                self.released.setdefault(index, []).append(tag)
        self.metrics["colocate/sleep_s"] = time.perf_counter() - started
        self.mark("after_sleep")

    async def _wake(self, tag: str) -> float:
        """Engines that released `tag` take it back; returns the seconds it took."""
        started = time.perf_counter()
        asleep = [i for i, tags in self.released.items() if tag in tags]
        await self._each(
            f"resume its {tag}",
            _resume(tag, self.co.resume_timeout_s),
            self.co.resume_timeout_s,
            "resume_timeout_s",
            asleep,
        )
        for index in asleep:
            self.released[index].remove(tag)
        return time.perf_counter() - started

    # ------------------------------------------------------------------ hand-over
    async def sync(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int, restarted: Iterable[int] = ()
    ) -> SyncReport:
        """Wakes the engines' weights, hands the (HF name, tensor) stream over as `version`,
        flushes their prefix cache, wakes their KV cache. restarted: engines started again since
        they last got weights (awake, holding their initial weights: they get these too)."""
        if self.version is not None and version <= self.version:
            raise ColocationError(f"version {version} is not newer than the last hand-over ({self.version})")
        for index in restarted:
            self.released.pop(index, None)  # a new process: nothing released
        self.mark("before_wake")
        wake_s = await self._wake(WEIGHTS)
        self.mark("after_wake_weights")
        stats = await self._hand_over(named, version)
        self.mark("after_handover")
        wake_s += await self._wake(KV_CACHE)
        self.mark("after_wake_kv_cache")
        versions = [info["weight_version"] for info in await self._each("report its weight version", _model_info)]
        wrong = [(c, v) for c, v in zip(self.clients, versions) if v != str(version)]
        if wrong:
            client, held = wrong[0]
            raise ColocationError(
                f"engine {client.base_url} holds weight version {held} after the hand-over of {version}"
            )
        self.version = version
        self.metrics.update(
            {"colocate/wake_s": wake_s, "colocate/handover_s": stats.seconds, "colocate/handover_bytes": stats.bytes}
        )
        return SyncReport(version, stats.buckets, stats.tensors, stats.bytes, stats.seconds, engine_version=version)

    async def _hand_over(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> HandoverStats:
        """Flattened buckets, update_weights_from_tensor to every engine at once (one payload
        per TP rank), each call bounded; the engines' prefix cache flushed after the last."""
        from megatron_rlvr.weight_sync.tensor_handover import hand_over

        bound = self.co.handover_timeout_s
        try:
            return await hand_over(
                list(zip(self.clients, self.engine_ranks)),
                named,
                bucket_bytes=self.bucket_bytes,
                weight_version=str(version),
                device=self.device,
                timeout_s=bound,
            )
        except Exception as err:
            raise ColocationError(
                f"the hand-over of weight version {version} failed (launch.colocation.handover_timeout_s = {bound:g} s): "
                f"{err}"
            ) from err

    async def _each(
        self,
        what: str,
        call: Callable[..., Awaitable[Any]],
        timeout_s: float | None = None,
        setting: str | None = None,
        engines: list[int] | None = None,
    ) -> list[Any]:
        """call(client[, index]) on every engine (or `engines`) at once, each bounded by
        timeout_s; the first engine that fails or does not answer ends the run, named."""
        indices = list(range(len(self.clients))) if engines is None else engines
        bound = timeout_s if timeout_s is not None else self.co.resume_timeout_s
        tasks = [asyncio.create_task(asyncio.wait_for(call(self.clients[i], i), bound)) for i in indices]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for index, result in zip(indices, results):
            if isinstance(result, BaseException):
                for task in tasks:
                    task.cancel()
                url = self.clients[index].base_url
                if isinstance(result, asyncio.TimeoutError):
                    where = f" (launch.colocation.{setting})" if setting else ""
                    raise ColocationError(f"engine {url} did not {what} within {bound:g} s{where}") from None
                raise ColocationError(f"engine {url} could not {what}: {result}") from result
        return list(results)

    async def close(self) -> None:
        """Nothing to tear down: no update group was formed."""


def _release(tag: str, timeout_s: float) -> Callable[[EngineClient, int], Awaitable[Any]]:
    return lambda client, _: client.release_memory_occupation([tag], timeout_s=timeout_s)


def _resume(tag: str, timeout_s: float) -> Callable[[EngineClient, int], Awaitable[Any]]:
    return lambda client, _: client.resume_memory_occupation([tag], timeout_s=timeout_s)


def _model_info(client: EngineClient, _: int) -> Awaitable[dict]:
    return client.model_info()
