"""Verifiers that turn a response into a reward. Each record names its verifier: `math`
(sympy in sandboxed workers), `code` (Python run against the record's tests in the sandbox) or
one of the user's functions (verifier.functions); `registry.Verifiers` dispatches to them.
VERIFIERS holds the built-in batch functions, (responses, golds, timeout_s) → verdicts."""

from megatron_rlvr.rewards.math.verifier import verify_math_batch

VERIFIERS = {"math": verify_math_batch}
