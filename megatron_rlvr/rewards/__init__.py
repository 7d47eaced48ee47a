"""Verifiers that turn a response into a reward, behind one registry keyed by the config's
`verifier.kind`. Each entry is a batch function (responses, golds, timeout_s) → verdicts."""

from megatron_rlvr.rewards.math import verify_math_batch

VERIFIERS = {"math": verify_math_batch}
