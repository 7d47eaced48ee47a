"""Every verifier of a run behind one call: a group's responses go to the verifier its record
names (math, code, ifeval, judge, or one of the user's functions), with reasoning stripped first
(math, code, ifeval and judge strip it themselves). A judge's verdicts may have no reward (a
group it could not score: the buffer drops it)."""

from __future__ import annotations

from collections import Counter, defaultdict

from megatron_rlvr.config import VerifierConfig
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.rewards.code.verifier import CodeVerifier
from megatron_rlvr.rewards.custom import function_verifier
from megatron_rlvr.rewards.instruction.verifier import IFEvalVerifier
from megatron_rlvr.rewards.judge.client import JudgeEndpoint
from megatron_rlvr.rewards.judge.verifier import JudgeVerdict, JudgeVerifier
from megatron_rlvr.rewards.math.verifier import MathVerifier
from megatron_rlvr.rewards.verdict import FAILURES, Verdict


class Verifiers:
    def __init__(self, cfg: VerifierConfig, functions: dict[str, dict], judge: JudgeEndpoint | None = None):
        """functions: verifier.functions resolved by custom.resolve_function; judge: where
        verifier.judge answers. One sandbox process per verifier: a run has
        verifier.num_workers of these, scoring groups at once."""
        self.math = MathVerifier(timeout_s=cfg.timeout_s, num_workers=1)
        self.code = CodeVerifier(
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
            max_output_kb=cfg.code.max_output_kb,
            reward=cfg.code.reward,
            parallel=1,
        )
        self.ifeval = IFEvalVerifier(
            grading=cfg.ifeval.grading, loose=cfg.ifeval.loose, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb
        )
        self.judge = JudgeVerifier(cfg.judge, judge) if cfg.judge is not None and judge is not None else None
        self.functions = {
            name: function_verifier(spec, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb)
            for name, spec in functions.items()
        }

    def verify(self, responses: list[str], record: PromptRecord) -> list[Verdict] | list[JudgeVerdict]:
        """(reward, reason) per response to `record`."""
        if record.verifier == "math":
            # math strips reasoning itself, so that a response cut off inside <think> counts as
            # no_final_answer, apart from one that gave no answer at all
            return self.math.verify_batch(responses, [str(record.answer)] * len(responses))
        if record.verifier == "code":
            return self.code.verify_batch(responses, record.answer)  # extract_code strips reasoning
        if record.verifier == "ifeval":
            return self.ifeval.verify_batch(responses, record)  # the checkers strip reasoning
        if record.verifier == "judge" and self.judge is not None:
            return self.judge.verify_batch(responses, record)
        return self.functions[record.verifier].verify_batch(responses, record.to_dict())

    def close(self) -> None:
        self.math.close()
        self.ifeval.close()
        if self.judge is not None:
            self.judge.close()


class VerdictStats:
    """Reason counts overall (`verifier/<reason>`) and per verifier (`verifier/<name>/<reason>`,
    `verifier/<name>/reward_mean`, `verifier/<name>/samples`, `verifier/<name>/failures`: the
    reasons in verdict.FAILURES, `verifier/<name>/time_s`: seconds its calls took), and the judge's
    request counts (`verifier/judge/requests`, `/retries`, `/cache_hits`, `/groups_dropped`) since the last take."""

    def __init__(self):
        self.reasons: Counter[str] = Counter()
        self.by_verifier: dict[str, Counter[str]] = defaultdict(Counter)
        self.reward_sum: defaultdict[str, float] = defaultdict(float)
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counters: Counter[str] = Counter()  # "judge/<count>"

    def add(self, verifier: str, verdicts: list[Verdict] | list[JudgeVerdict], seconds: float = 0.0) -> None:
        self.reasons.update(reason for _, reason in verdicts)
        self.by_verifier[verifier].update(reason for _, reason in verdicts)
        self.reward_sum[verifier] += sum(reward or 0.0 for reward, _ in verdicts)
        self.seconds[verifier] += seconds

    def merge(self, other: VerdictStats) -> None:
        self.reasons.update(other.reasons)
        for name, counts in other.by_verifier.items():
            self.by_verifier[name].update(counts)
        for name, total in other.reward_sum.items():
            self.reward_sum[name] += total
        for name, seconds in other.seconds.items():
            self.seconds[name] += seconds
        self.counters.update(other.counters)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"verifier/{reason}": n for reason, n in sorted(self.reasons.items())}
        for name, counts in sorted(self.by_verifier.items()):
            samples = sum(counts.values())
            out[f"verifier/{name}/samples"] = samples
            out[f"verifier/{name}/reward_mean"] = self.reward_sum[name] / samples
            out[f"verifier/{name}/failures"] = sum(n for reason, n in counts.items() if reason in FAILURES)
            out[f"verifier/{name}/time_s"] = self.seconds[name]
            out.update({f"verifier/{name}/{reason}": n for reason, n in sorted(counts.items())})
        out.update({f"verifier/{name}": n for name, n in sorted(self.counters.items())})
        return out
