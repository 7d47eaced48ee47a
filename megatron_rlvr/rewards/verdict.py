"""What every verifier returns for one response: (reward, reason). The reason names why the
reward is what it is (`exact`, `wrong_answer`, `timeout`, ...) and is counted in the run's
metrics as `verifier/<reason>`."""

Verdict = tuple[float, str]

# Reasons that are no verdict on what the answer says: its check timed out, ran out of memory,
# crashed or found no sandbox (counted per verifier as verifier/<name>/failures).
FAILURES = frozenset({"timeout", "memory", "crashed", "sandbox_error", "sandbox_unavailable", "worker_died"})
