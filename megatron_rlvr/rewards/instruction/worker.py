"""The ifeval verifier's sandbox supervisor, started once and kept (verifier.py): it loads the
checkers once (the library and `datasets` with it, NLTK's data, langdetect's profiles: more CPU
than a group's checks), confines itself as the sandbox's supervisors do (runner.py: capabilities
dropped, writes only under its directory), then scores every batch it is sent, one JSON line
each, each response in a forked child with the seccomp filter, the rlimits and the wall-time
deadline of runner.in_child. It answers one JSON line per response, in order."""

from __future__ import annotations

import json
import os
import sys


def serve() -> None:
    from megatron_rlvr.rewards.instruction.checkers import score  # loads everything, before confinement
    from megatron_rlvr.rewards.isolation import confine_writes, drop_capabilities
    from megatron_rlvr.rewards.runner import call_function, in_child

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing a checker prints can corrupt the protocol
    drop_capabilities()
    confine_writes(os.getcwd())
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        batch = json.loads(line)
        settings = {**batch["settings"], "readable": None}
        for job in batch["jobs"]:

            def target(job: dict = job) -> dict:
                return call_function(score, job["response"], job["record"])

            outcome = in_child(target, settings, wall_s=settings["wall_s"])
            protocol.write(json.dumps({"outcome": outcome}) + "\n")


if __name__ == "__main__":
    serve()
