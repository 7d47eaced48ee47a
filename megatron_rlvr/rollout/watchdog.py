"""Stops an engine server whose owner died: `python -m megatron_rlvr.rollout.watchdog OWNER
SERVER`. The launcher starts one beside each server (in a session of its own, so neither a
Ctrl-C nor the owner's death reaches it). Every second it checks the owner; once the owner is
gone (or its pid belongs to a new process) it sends SIGTERM to the server's process group,
and SIGKILL to what is left after a grace period. It exits when the server's group is gone.
Kept free of heavy imports: it starts in a few milliseconds and holds no memory to speak of."""

from __future__ import annotations

import os
import signal
import sys
import time


def started_at(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), to tell it from a later process
    that reuses its pid; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(owner: int, server_group: int, *, interval_s: float = 1.0, grace_s: float = 10.0) -> int:
    owner_start = started_at(owner)
    while group_alive(server_group):
        if owner_start is None or started_at(owner) != owner_start:
            try:
                os.killpg(server_group, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and group_alive(server_group):
                    time.sleep(0.1)
                os.killpg(server_group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return 1
        time.sleep(interval_s)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner's death or its own SIGKILL stop it
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2])))
