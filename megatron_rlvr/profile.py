"""`megatron-rlvr profile CONFIG`: what a data set will cost to train on, before training.

The run's own engines (the initial policy, its sampling settings) sample n answers for a
seeded sample of the training prompts, and the run's verifiers score them; no learner starts.
Each group is all wrong, all right (every reward equal, as the buffer's zero-std rule sees it:
no gradient) or mixed (useful). Per domain (a record's verifier), the command prints the
shares and what they imply under active sampling: a useful group costs 1 / share_mixed groups
generated on average (with the 95% Wilson interval of the share as its bound), and a step of
buffer.batch_groups useful groups costs batch_groups times that. It writes a prompt-difficulty
file (JSONL, a row per prompt: id, domain, n, pass_rate, mean_reward, outcome) that
data.difficulty_file reads to skip prompts that carry no signal (data.difficulty_skip)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import random
import secrets
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.config import ResolvedConfig, load_config
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.data.selection import OUTCOMES, Difficulty, domain_of, write_difficulty
from megatron_rlvr.stopping import StopRequested, StopSignals

Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def outcome_of(rewards: list[float], eps: float) -> str:
    """mixed when the rewards differ (the buffer keeps the group), else all right when the one
    reward is positive and all wrong when it is not (as the prompt history counts them)."""
    if statistics.pstdev(rewards) > eps:
        return "mixed"
    return "all_right" if rewards[0] > 0 else "all_wrong"


def difficulty(record: PromptRecord, rewards: list[float], eps: float) -> Difficulty:
    """A prompt's row of the difficulty file; a sample is right when its reward is at least 1."""
    return Difficulty(
        record.prompt_id,
        domain_of(record),
        len(rewards),
        sum(r >= 1.0 for r in rewards) / len(rewards),
        statistics.fmean(rewards),
        outcome_of(rewards, eps),
    )


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a share k/n."""
    p, z2 = k / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, center - half), min(1.0, center + half)


@dataclass(frozen=True)
class DomainProfile:
    """One domain's (or all prompts') outcome counts and the generation they imply."""

    domain: str
    counts: dict[str, int]

    @property
    def prompts(self) -> int:
        return sum(self.counts.values())

    def share(self, outcome: str) -> float:
        return self.counts.get(outcome, 0) / self.prompts

    def groups_per_useful(self) -> tuple[float, float, float]:
        """Groups generated per useful group: 1 / share_mixed, and its bounds from the
        share's 95% interval (low, expected, high; inf where no group would be useful)."""
        low, high = wilson(self.counts.get("mixed", 0), self.prompts)
        share = self.share("mixed")
        return (1 / high, 1 / share if share else math.inf, 1 / low if low else math.inf)


@dataclass(frozen=True)
class MixProfile:
    """The domains as data.mixing draws them: each share the weighted mean of the domains'
    shares, and its bounds the weighted means of theirs (each domain's 95% interval at once:
    wider than one 95% interval of the mix)."""

    parts: list[tuple[DomainProfile, float]]  # (a domain's profile, its weight)
    domain: str = "as mixed"

    @property
    def prompts(self) -> int:
        return sum(p.prompts for p, _ in self.parts)

    def _mean(self, values: list[float]) -> float:
        return sum(v * w for v, (_, w) in zip(values, self.parts)) / sum(w for _, w in self.parts)

    def share(self, outcome: str) -> float:
        return self._mean([p.share(outcome) for p, _ in self.parts])

    def groups_per_useful(self) -> tuple[float, float, float]:
        bounds = [wilson(p.counts.get("mixed", 0), p.prompts) for p, _ in self.parts]
        low, share, high = (
            self._mean([lo for lo, _ in bounds]),
            self.share("mixed"),
            self._mean([hi for _, hi in bounds]),
        )
        return (1 / high, 1 / share if share else math.inf, 1 / low if low else math.inf)


def summarize(rows: list[Difficulty], mixing: dict[str, float] | None = None) -> list[DomainProfile | MixProfile]:
    """A profile per domain, in name order; with several domains, one of all prompts profiled
    and, with data.mixing, one of the domains as the run draws them."""
    by_domain: dict[str, Counter[str]] = {}
    for row in rows:
        by_domain.setdefault(row.domain, Counter())[row.outcome] += 1
    domains = [DomainProfile(d, dict(by_domain[d])) for d in sorted(by_domain)]
    found: list[DomainProfile | MixProfile] = list(domains)
    if len(domains) > 1:
        found.append(DomainProfile("all", dict(Counter(row.outcome for row in rows))))
        if mixing:
            found.append(MixProfile([(p, mixing[p.domain]) for p in domains if p.domain in mixing]))
    return found


def _groups(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.1f}"


def table(profiles: list[DomainProfile | MixProfile], n: int, batch_groups: int) -> str:
    """The profile as a Markdown table (the docs show it as printed)."""
    lines = [
        f"| domain | prompts | all wrong | all right | mixed | groups per useful group (95%) | "
        f"groups per step of {batch_groups} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in profiles:
        low, expected, high = p.groups_per_useful()
        shares = " | ".join(f"{100 * p.share(o):.1f}%" for o in OUTCOMES)
        per_step = "∞" if math.isinf(expected) else f"{math.ceil(batch_groups * expected)}"
        lines.append(
            f"| {p.domain} | {p.prompts} | {shares} | {_groups(expected)} ({_groups(low)}–{_groups(high)}) | {per_step} |"
        )
    return "\n".join(lines) + f"\n\n(n = {n} samples per prompt)"


def sample_prompts(records: list[PromptRecord], count: int | None, seed: int) -> list[PromptRecord]:
    """`count` distinct prompts drawn with `seed`, in data order (all of them: None or more)."""
    unique = list({r.prompt_id: r for r in records}.values())
    if count is None or count >= len(unique):
        return unique
    chosen = set(random.Random(seed).sample(range(len(unique)), count))
    return [r for i, r in enumerate(unique) if i in chosen]


async def wait_for_group(queue: asyncio.Queue, wait_s: float, stop: StopSignals):
    """The next finished group; a stop request is seen within a second, and no group in
    wait_s means the engines are stuck (an error saying so)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline:
        stop.check("while profiling")
        try:
            return await asyncio.wait_for(queue.get(), min(1.0, max(deadline - loop.time(), 0.0)))
        except TimeoutError:
            continue
    raise TimeoutError(f"profile: no group came back from the engines in {wait_s:.0f} s")


async def _score_all(cfg: ResolvedConfig, encoded, manager, score, decode, sampling, stop: StopSignals) -> tuple:
    """(difficulty rows in prompt order, failed prompt ids: the engines or the judge could not
    give the group): each prompt sampled once, at most 64 groups in flight; a group that does
    not come back in time is an error."""
    from megatron_rlvr.rollout.manager import PromptItem

    queue: asyncio.Queue = asyncio.Queue()
    records = encoded.records
    rows: dict[int, Difficulty] = {}
    failed: list[str] = []
    submitted: dict[str, int] = {}
    wait_s = cfg.rollout.request_timeout_s * (manager.max_attempts + 1) + 60
    nxt = 0
    while nxt < len(records) or submitted:
        while nxt < len(records) and len(submitted) < 64:
            seed = (cfg.trainer.seed * 1_000_003 + nxt) % 2**62 if cfg.rollout.seeded_sampling else None
            item = PromptItem(records[nxt].prompt_id, encoded.encode(records[nxt]), seed=seed)
            submitted[manager.submit(item, sampling=sampling, to=queue)] = nxt
            nxt += 1
        group = await wait_for_group(queue, wait_s, stop)
        index = submitted.pop(group.group_id)
        if group.error is not None or group.aborted or not group.samples:
            failed.append(records[index].prompt_id)
            continue
        rewards = await score([decode(s.response_ids) for s in group.samples], records[index], count=False)
        if any(r is None for r in rewards):  # a judge that could not score the group
            failed.append(records[index].prompt_id)
            continue
        rows[index] = difficulty(records[index], rewards, cfg.buffer.zero_std_eps)
    return [rows[i] for i in sorted(rows)], failed


def profile(cfg: ResolvedConfig, *, prompts: int | None, n: int, stop: StopSignals) -> tuple[list[Difficulty], list]:
    """Samples and scores; (difficulty rows, failed prompt ids). Starts the run's engines and
    verifiers where its placement puts them, and stops them whatever happens."""
    from megatron_rlvr.data import PromptRenderer
    from megatron_rlvr.data.check import check_inputs
    from megatron_rlvr.launch.engines import EngineFleet
    from megatron_rlvr.launch.placement import placement_for
    from megatron_rlvr.launch.verifiers import VerifierPool
    from megatron_rlvr.rollout import protocol as p
    from megatron_rlvr.rollout.client import EngineClient
    from megatron_rlvr.rollout.manager import RolloutManager
    from megatron_rlvr.run import _run_temp_dir, prepare_model

    records = check_inputs(cfg, select=False)["data"].records  # every prompt, before mixing and skips
    chosen = sample_prompts(records, prompts, cfg.trainer.seed)
    placement = placement_for(cfg)
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(cfg)
    encoded = PromptRenderer(tokenizer, cfg.data).encode(chosen)
    eos = tokenizer.eos_token_id
    sampling = p.SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        n=n,
        stop_token_ids=[eos] if eos is not None else None,
    )
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    api_key = secrets.token_urlsafe(32)
    with contextlib.ExitStack() as stack:
        temp_dir = stack.enter_context(_run_temp_dir())
        stack.enter_context(placement.session(str(Path(temp_dir) / "ray")))
        engines = EngineFleet(cfg, model_dir, placement, api_key)
        stack.callback(engines.stop)
        urls = engines.start(stop)
        verifiers = VerifierPool(cfg, placement, api_key)  # a judge the run serves takes its key
        stack.callback(verifiers.close)

        async def sample() -> tuple:
            clients = [EngineClient(url, api_key=api_key, timeout_s=cfg.rollout.request_timeout_s) for url in urls]

            async def restart(engine: int) -> str | None:
                return await asyncio.to_thread(engines.restart, engine)

            try:
                manager = RolloutManager(clients, sampling, restart=restart)
                return await _score_all(cfg, encoded, manager, verifiers, decode, sampling, stop)
            finally:
                for client in clients:
                    await client.close()

        return asyncio.run(sample())


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "profile", help="sample the initial policy on the training prompts: all-wrong / all-right / mixed per domain"
    )
    parser.add_argument("config", help="YAML config, e.g. configs/tiny-moe-cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides: rollout.temperature=0.8")
    parser.set_defaults(takes_overrides=True)
    parser.add_argument("--prompts", type=int, default=256, help="prompts sampled (0: every prompt; default 256)")
    parser.add_argument("--n", type=int, default=None, help="answers per prompt (default rollout.n_samples_per_prompt)")
    parser.add_argument(
        "--out", default=None, help="the difficulty file to write (default: trainer.output_dir/difficulty.jsonl)"
    )


def main(args: argparse.Namespace, stop: StopSignals) -> int:
    import logging

    from megatron_rlvr.errors import UserError

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    cfg = load_config(args.config, args.overrides)
    n = args.n or cfg.rollout.n_samples_per_prompt
    if n < 2 or args.prompts < 0:
        raise UserError(f"profile: --n = {n} must be at least 2 (one answer has no spread) and --prompts >= 0")
    try:
        rows, failed = profile(cfg, prompts=args.prompts or None, n=n, stop=stop)
    except StopRequested as err:
        print(f"megatron-rlvr profile: {err}; every component was stopped, nothing was written", file=sys.stderr)
        return 130
    out = Path(args.out or Path(cfg.trainer.output_dir) / "difficulty.jsonl")
    write_difficulty(out, rows)
    print(table(summarize(rows, cfg.data.mixing), n, cfg.buffer.batch_groups))
    if failed:
        print(f"{len(failed)} prompts failed (engines or judge) and are not counted (first: {failed[0]})")
    print(f"megatron-rlvr profile: {len(rows)} prompts profiled; difficulty file: {out}", file=sys.stderr)
    return 0
