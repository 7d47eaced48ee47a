"""What the loop's overlap buys and costs, per step: how stale the trained tokens were (in
policy versions, token by token), how many sequences mixed versions, and how busy the
engines and the learner were over the step's wall time."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megatron_rlvr.learner.batch import TrainBatch


def staleness_metrics(batch: TrainBatch, policy_version: int) -> dict[str, float]:
    """Versions behind `policy_version` (the policy this batch trains) of every response token
    that enters the loss: min/mean/max, and the share of sequences whose tokens came from
    more than one version (an update landed while they were generated)."""
    if batch.token_versions is None:
        return {}
    counted = batch.response_mask > 0
    behind = (policy_version - batch.token_versions)[counted].float()
    if not behind.numel():
        return {}
    rows = counted.any(1)
    highest = torch.where(counted, batch.token_versions, torch.full_like(batch.token_versions, -(2**62))).amax(1)
    lowest = torch.where(counted, batch.token_versions, torch.full_like(batch.token_versions, 2**62)).amin(1)
    mixed = (highest != lowest)[rows].float().mean()
    return {
        "staleness/min": float(behind.min()),
        "staleness/mean": float(behind.mean()),
        "staleness/max": float(behind.max()),
        "staleness/mixed_version_share": float(mixed),
    }


class BusyClock:
    """Seconds during which at least one of a thing's requests was running, for busy
    fractions; start() and stop() bracket each request, pause() and resume() a weight sync.
    A paused engine generates nothing, so its requests waiting out a sync are idle time."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._active = 0
        self._paused = False
        self._since = 0.0
        self._busy_s = 0.0

    def _running(self) -> bool:
        return self._active > 0 and not self._paused

    def _change(self, active: int, paused: bool, at: float | None = None) -> None:
        now, was = self._now(), self._running()
        self._active, self._paused = active, paused
        if was and not self._running():
            self._busy_s += now - self._since
        elif not was and self._running():
            self._since = now if at is None else min(at, now)

    def start(self) -> None:
        self._change(self._active + 1, self._paused)

    def stop(self) -> None:
        self._change(self._active - 1, self._paused)

    def pause(self) -> None:
        self._change(self._active, True)

    def resume(self, at: float | None = None) -> None:
        """at: when the engine resumed, if earlier than now (the clock's own time, after the
        pause): requests running now have run since then."""
        self._change(self._active, False, at)

    def take(self) -> float:
        """Busy seconds since the last take (a running stretch counts up to now)."""
        now = self._now()
        busy = self._busy_s + (now - self._since if self._running() else 0.0)
        self._busy_s, self._since = 0.0, now
        return busy
