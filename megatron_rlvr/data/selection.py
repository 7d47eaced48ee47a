"""Which training prompts a run draws. A record's domain is the verifier that scores it (math,
code, ifeval, judge, or one of the user's functions), so one data set can mix math, code,
instruction-following and judged records, each with its share and its own numbers.

    select_prompts(records, data, seed)   mixed by data.mixing (weights per domain, a seeded
                                          draw), less the prompts data.difficulty_file skips
    read_difficulty / write_difficulty    the prompt-difficulty file of `megatron-rlvr profile`

Mixing happens once, at load: the list the sampler shuffles holds each domain's share of the
prompts (a domain drawn more often than it has prompts repeats whole, then a seeded sample of
the rest, as data.weights mixes files), so the draw follows data.seed and a resumed run, which
loads the same list, draws on where it stopped."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlvr.data.records import DataError, PromptRecord

if TYPE_CHECKING:
    from megatron_rlvr.config.selection import PromptSelection

OUTCOMES = ("all_wrong", "all_right", "mixed")
SKIPPED = {"all_wrong": {"all_wrong"}, "all_right": {"all_right"}, "both": {"all_wrong", "all_right"}}


def domain_of(record: PromptRecord) -> str:
    return record.verifier


def mix_by_domain(records: list[PromptRecord], weights: dict[str, float], seed: int) -> list[PromptRecord]:
    """`records` drawn so that each domain holds its weight's share of them (as many prompts
    in all as there are records). Every domain of the data needs a weight, and every weight a
    domain: a typo would otherwise mix silently without one."""
    by_domain: dict[str, list[PromptRecord]] = defaultdict(list)
    for record in records:
        by_domain[domain_of(record)].append(record)
    missing = sorted(set(by_domain) - set(weights))
    if missing:
        raise DataError(
            f"data.mixing has no weight for the domain(s) {', '.join(missing)} of the data "
            f"(domains: {', '.join(sorted(by_domain))})"
        )
    absent = sorted(set(weights) - set(by_domain))
    if absent:
        raise DataError(
            f"data.mixing names {', '.join(absent)}, which no record of the data is scored by "
            f"(domains: {', '.join(sorted(by_domain))})"
        )
    rng, total, mixed = random.Random(seed), len(records), []
    for domain in sorted(by_domain):  # a fixed order: the draw depends on the seed alone
        own = by_domain[domain]
        want = max(1, round(total * weights[domain] / sum(weights.values())))
        whole, rest = divmod(want, len(own))
        mixed.extend(own * whole + rng.sample(own, rest))
    return mixed


@dataclass(frozen=True)
class Difficulty:
    """One prompt's profile: n samples, the share right (reward >= 1), the mean reward, and
    whether the group was all wrong, all right (equal rewards) or mixed."""

    prompt_id: str
    domain: str
    n: int
    pass_rate: float
    mean_reward: float
    outcome: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.prompt_id,
                "domain": self.domain,
                "n": self.n,
                "pass_rate": self.pass_rate,
                "mean_reward": self.mean_reward,
                "outcome": self.outcome,
            }
        )


def write_difficulty(path: Path, rows: list[Difficulty]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(row.to_json() + "\n" for row in rows), encoding="utf-8")


def read_difficulty(path: str | Path, where: str = "data.difficulty_file") -> dict[str, Difficulty]:
    """prompt id → its profile; a missing file or a bad line is a DataError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{where} = '{path}': no such file (write one with `megatron-rlvr profile CONFIG`)")
    found: dict[str, Difficulty] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            entry = Difficulty(
                str(row["id"]),
                str(row.get("domain", "")),
                int(row["n"]),
                float(row["pass_rate"]),
                float(row.get("mean_reward", row["pass_rate"])),
                str(row["outcome"]),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"{path}:{number}: not a difficulty row ({type(err).__name__}: {err}; "
                "expected id, n, pass_rate, outcome)"
            ) from None
        if entry.outcome not in OUTCOMES:
            raise DataError(f"{path}:{number}: outcome {entry.outcome!r} is not one of {', '.join(OUTCOMES)}")
        found[entry.prompt_id] = entry
    return found


def select_prompts(records: list[PromptRecord], data: PromptSelection, seed: int) -> list[PromptRecord]:
    """The training prompts a run draws from: the difficulty skip first (so the mixing shares
    are of the prompts left), then the mixing. Skipping every prompt of the data is an error."""
    if data.difficulty_file is not None:
        profiled = read_difficulty(data.difficulty_file)
        skip = SKIPPED[data.difficulty_skip]
        kept = [r for r in records if r.prompt_id not in profiled or profiled[r.prompt_id].outcome not in skip]
        if not kept:
            raise DataError(
                f"data.difficulty_file = '{data.difficulty_file}' skips every prompt of the data "
                f"(data.difficulty_skip = {data.difficulty_skip}): nothing left to train on"
            )
        records = kept
    if data.mixing:
        records = mix_by_domain(records, data.mixing, seed)
    return records


def check_set_names(sets: dict[str, list[PromptRecord]]) -> None:
    """A set may take a domain's name (eval/math/...) only when it holds that domain's every
    eval record and no other: else the set's figures and the domain's would share one name."""
    domains = {name: {domain_of(r) for r in records} for name, records in sets.items()}
    for name, own in domains.items():
        holders = [other for other, found in domains.items() if name in found]
        if holders and (own != {name} or holders != [name]):
            raise DataError(
                f"eval.sets.{name}: a set may take the name of the domain {name!r} only when it holds every eval "
                f"record of that domain and no other (eval/{name}/... holds the domain's figures): rename the set"
            )
