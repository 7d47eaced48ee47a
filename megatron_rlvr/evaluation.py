"""Evaluation while training: the held-out sets of `eval` are sampled by the engines (their
own sampling settings and seeds, their own result queue) and scored by the run's verifiers
without counting toward the training metrics. The training data, its order and its sampling
seeds are never touched, so a seeded run trains on the same groups with evaluation on or off.

Per set: pass@1 and pass@k (the unbiased estimator of Chen et al. 2021, a sample counts as
correct when its reward is at least 1), avg@n (mean reward over all n samples of every prompt),
mean response length in tokens (an episode's sampled tokens: tool turns excluded) and the fraction
of responses cut at max_new_tokens. With an agent, every prompt is an episode whose final model
turn is scored. A group the
engines failed (error, abort, timeout) counts as all wrong, and eval/<set>/failed says how many."""

from __future__ import annotations

import asyncio
import hashlib
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from megatron_rlvr.config import ResolvedConfig
from megatron_rlvr.data.chat import EncodedPrompts
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.manager import PromptItem, RolloutManager
from megatron_rlvr.rollout.sampler import answer_text


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n samples, c
    of them correct, is correct: 1 − C(n−c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalSet:
    name: str
    prompts: EncodedPrompts


class Evaluator:
    def __init__(
        self,
        cfg: ResolvedConfig,
        sets: list[EvalSet],
        manager: RolloutManager,
        score: Callable[..., Awaitable[list[float]]],
        decode: Callable[[list[int]], str],
        stop_token_ids: list[int] | None,
        max_in_flight: int = 64,
        messages: Callable[[PromptRecord], list[dict]] | None = None,
    ):
        """score(responses, record, count=False) → rewards: the run's verifier pool. messages:
        a record's conversation, when the manager runs groups as episodes (its agent)."""
        e = cfg.eval
        self.cfg, self.sets, self.manager, self.score, self.decode = e, sets, manager, score, decode
        self.last_step, self.seeded, self.max_in_flight = cfg.trainer.steps, cfg.rollout.seeded_sampling, max_in_flight
        self.messages = messages if manager.agent is not None else None
        self.sampling = p.SamplingParams(
            max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
            temperature=e.temperature,
            top_p=e.top_p,
            n=e.n_samples,
            stop_token_ids=stop_token_ids,
        )
        self.ks = sorted(set(e.pass_k or [1, e.n_samples]) | {1})
        # a group that finishes neither way within this bound means the engines are stuck
        self.wait_s = cfg.rollout.request_timeout_s * (manager.max_attempts + 1) + 60

    def due(self, step: int) -> bool:
        """Step 0 (before training, at_start), every `interval` steps, and the last step."""
        if not self.sets:
            return False
        if step == 0:
            return self.cfg.at_start
        return step == self.last_step or bool(self.cfg.interval and step % self.cfg.interval == 0)

    def _seed(self, name: str, prompt_id: str) -> int | None:
        """The same seed at every evaluation, so curves compare policies, not sampling noise."""
        if not self.seeded:
            return None
        digest = hashlib.sha256(f"{self.cfg.seed}/{name}/{prompt_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % 2**62

    async def evaluate(self) -> dict[str, float]:
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        for eval_set in self.sets:
            metrics.update(await self._evaluate_set(eval_set))
        metrics["time/eval_s"] = time.perf_counter() - started
        return metrics

    async def _evaluate_set(self, eval_set: EvalSet) -> dict[str, float]:
        records = eval_set.prompts.records[: self.cfg.max_prompts]
        queue: asyncio.Queue = asyncio.Queue()
        submitted: dict[str, int] = {}
        results: dict[int, tuple[list[float], list[int], list[bool]]] = {}
        scoring: list[asyncio.Task] = []
        failed = 0

        async def score(index: int, record: PromptRecord, group) -> None:
            answers = [answer_text(s, self.decode) for s in group.samples]
            rewards = await self.score(answers, record, count=False)
            if self.manager.agent is not None:
                rewards = [self.manager.agent.reward(r, s) for r, s in zip(rewards, group.samples)]
            results[index] = (
                rewards,
                [s.sampled_tokens() for s in group.samples],
                [s.finish_reason == "length" for s in group.samples],
            )

        next_index = 0
        while next_index < len(records) or submitted:
            while next_index < len(records) and len(submitted) < self.max_in_flight:
                record = records[next_index]
                item = PromptItem(
                    record.prompt_id, eval_set.prompts.encode(record), seed=self._seed(eval_set.name, record.prompt_id)
                )
                if self.messages is not None:  # an episode renders its own prompt, tools included
                    item.messages, item.extra = self.messages(record), record.extra
                submitted[self.manager.submit(item, sampling=self.sampling, to=queue)] = next_index
                next_index += 1
            try:
                group = await asyncio.wait_for(queue.get(), self.wait_s)
            except TimeoutError:
                raise TimeoutError(
                    f"evaluation of eval.sets.{eval_set.name}: no group came back from the engines "
                    f"in {self.wait_s:.0f} s ({len(submitted)} in flight)"
                ) from None
            index = submitted.pop(group.group_id)
            if group.error is not None or group.aborted or not group.samples:
                failed += 1
                continue
            scoring.append(asyncio.create_task(score(index, records[index], group)))
        await asyncio.gather(*scoring)
        return self._summary(eval_set.name, [results[i] for i in sorted(results)], failed)

    def _summary(self, name: str, results: list, failed: int) -> dict[str, float]:
        return summarize(f"eval/{name}", results, failed, self.cfg.n_samples, self.ks)


def summarize(prefix: str, results: list, failed: int, n: int, ks: list[int]) -> dict[str, float]:
    """One set's metrics from its scored groups ((rewards, lengths, cut) each) and the number
    that failed (engine error, abort, timeout). A failed group counts as n wrong samples in
    pass@k and avg@n: dropping it would score a set on the prompts the engines managed, and a
    set whose hard prompts time out would look better. Lengths are of real responses only."""
    out: dict[str, float] = {f"{prefix}/prompts": len(results) + failed, f"{prefix}/failed": failed}
    if not results and not failed:
        return out
    correct = [sum(r >= 1.0 for r in rewards) for rewards, _, _ in results] + [0] * failed
    for k in ks:
        out[f"{prefix}/pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in correct)
    out[f"{prefix}/avg@{n}"] = sum(r for rewards, _, _ in results for r in rewards) / (n * len(correct))
    if results:
        out[f"{prefix}/response_length"] = statistics.fmean(x for _, lengths, _ in results for x in lengths)
        out[f"{prefix}/truncated"] = statistics.fmean(t for _, _, cut in results for t in cut)
    return out


def build_evaluator(
    cfg: ResolvedConfig,
    renderer,
    manager: RolloutManager,
    score,
    decode,
    stop_token_ids: list[int] | None,
    loaded: dict,
) -> Evaluator | None:
    """The run's evaluator, or None without eval sets. loaded: dotted name → LoadedPrompts."""
    if not cfg.eval.sets:
        return None
    sets = [
        EvalSet(name, renderer.encode(loaded[f"eval.sets.{name}"].records, what=f"eval.sets.{name}"))
        for name in cfg.eval.sets
    ]
    return Evaluator(cfg, sets, manager, score, decode, stop_token_ids, messages=renderer.messages)
