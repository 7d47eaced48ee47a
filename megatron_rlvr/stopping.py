"""Stop requests (Ctrl-C, SIGTERM from `kill` or Slurm's `scancel`) that are never lost.

A signal handler may run between any two bytecodes of the main thread, inside a finalizer
(`__del__`) or a C callback among them; an exception raised there is printed as "Exception
ignored" and the request is gone. So the handler only records the request. The run looks at
it at safe points: every blocking wait polls it (`wait_until`, `result`), and the loop checks
it between phases (`check`). The first request lets the step in progress finish its learner
work, then stops in order and saves a checkpoint; a second one skips the checkpoint and ends
at once, still stopping every child.
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.2  # how often a blocking wait looks at the stop request
# The same signal again within this time is one request, not two: under Slurm, `scancel`
# signals every process of the job and the job script passes its own SIGTERM on as well.
REPEAT_WINDOW_S = 1.0


class StopRequested(Exception):
    """Raised at a safe point after a stop request; carries which signal asked."""

    def __init__(self, signal_name: str, where: str):
        self.signal_name, self.where = signal_name, where
        super().__init__(f"stopped by {signal_name} {where}")


class StopSignals:
    """Records SIGINT and SIGTERM (never raises from the handler). One per command; the
    components of a run get it passed in and look at it at their safe points."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.count = 0
        self.signal_name = ""
        self.received_at: float | None = None  # time.monotonic() of the first request
        self._event = threading.Event()
        self._previous: dict = {}
        self._last: tuple[int, float] = (0, 0.0)  # (signal, time.monotonic()) of the latest one counted

    def install(self) -> StopSignals:
        """Takes SIGINT and SIGTERM over (main thread only, as Python requires)."""
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self._last[0] == signum and now - self._last[1] < REPEAT_WINDOW_S:
            return
        self._last = (signum, now)
        self.count += 1
        if self.count == 1:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()
        self._event.set()

    def request(self, signal_name: str = "request") -> None:
        """A stop asked for from code (tests, or a component that decides the run is over)."""
        self.count += 1
        self.signal_name = self.signal_name or signal_name
        self.received_at = self.received_at or time.monotonic()
        self._event.set()

    @property
    def requested(self) -> bool:
        return self.count > 0

    @property
    def urgent(self) -> bool:
        """A second request: skip the checkpoint and every graceful wait."""
        return self.count > 1

    def check(self, where: str) -> None:
        """Raises StopRequested at a safe point if a stop was asked for."""
        if self.requested:
            raise StopRequested(self.signal_name, where)

    def sleep(self, seconds: float) -> None:
        """time.sleep that returns early on a stop request."""
        self._event.wait(seconds)

    def wait_until(
        self, done: Callable[[float], bool], what: str, *, urgent_only: bool = False, timeout_s: float | None = None
    ) -> None:
        """Polls done(poll_seconds), which may block that long, until it returns True.

        Raises StopRequested on a stop request (with urgent_only, only on a second one: for
        work that must be let finish, such as a learner step or a checkpoint), and
        TimeoutError naming `what` after timeout_s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.urgent or (self.requested and not urgent_only):
                raise StopRequested(self.signal_name, f"while waiting for {what}")
            if done(POLL_S):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for {what}")

    def result(self, future: concurrent.futures.Future[T], what: str, *, urgent_only: bool = False) -> T:
        """future.result(), waited for in polls so that a stop request is seen."""
        self.wait_until(lambda t: not concurrent.futures.wait([future], t).not_done, what, urgent_only=urgent_only)
        return future.result()


def never() -> StopSignals:
    """A stop request nobody will make: for callers (tests, library use) without signals."""
    return StopSignals()
