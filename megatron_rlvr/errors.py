"""The one family of errors meant for the person running a command.

A UserError's message is one line that names what is wrong (a config field, a file and
line, an engine, a rank) and, where there is one, what to do. The command line prints it as
`megatron-rlvr <command>: <message>` and exits 2, without a traceback (cli.main is the one
place that does). Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """Base of every error a user can act on (bad config, missing file, an engine that cannot
    start, a checkpoint that does not fit). Subclass it; never raise it bare."""

    exit_code = 2

    def report(self, command: str) -> int:
        """Prints the error for `megatron-rlvr <command>` on stderr; returns the exit code."""
        print(f"megatron-rlvr {command}: {self}", file=sys.stderr)
        return self.exit_code


def original(err: BaseException) -> BaseException:
    """The error as raised: one raised inside a Ray actor reaches the caller wrapped in a
    RayTaskError (of the same class) whose text holds the remote traceback."""
    return getattr(err, "cause", None) or err
