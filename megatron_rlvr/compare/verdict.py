"""The stability verdict of a comparison: each run's stability numbers, and which replay mode,
if any, was more stable than another beyond the spread between seeds. Plain Python, no torch.
`compare-replay`'s report and the benchmarks that build on it (benchmarks/compare_replay_long.py,
benchmarks/off_policy.py) use this one rule.

Stability is judged by what routing replay does not lower by construction, each a number per
run where lower is more stable:
  - reward drop: the best window's mean reward minus the last window's (a reward collapse
    above COLLAPSE);
  - grad-norm peak: the largest grad norm after the first window over the run's median (the
    first steps from random weights are atypical everywhere; a spike above SPIKE);
  - entropy collapse: 1 for a run whose last window keeps less than ENTROPY_KEPT of the first
    window's policy entropy, else 0 (a policy that learns loses entropy: only a collapse counts;
    the share kept is shown beside it).
The train/inference mismatch KL is reported beside them and never ranks: R3 lowers it by
construction (the learner routes as the engine did), so ranking by it names R3 whatever happened
to training. A metric a run did not log is missing, never zero.

Windows are a fifth of the run and analysis.MIN_WINDOW steps at least; a run shorter than two windows
cannot be judged. Mode A is more stable than mode B when, on at least one of the three numbers,
A's mean over seeds is below B's by more than both that number's floor (Criterion.floor) and t × the
standard error of the difference (t: Student's 97.5% point at n_A + n_B − 2 degrees of
freedom), and on none is B's below A's by as much. That takes two seeds per mode at least: with
one, the spread between seeds is unknown. The most stable mode is the one more stable than
every other mode; without one the verdict is "no difference shown at this scale", with the
number of seeds per mode that would resolve the closest difference at the spread observed.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

from megatron_rlvr.compare.analysis import ENGINE_AGREEMENT, MISMATCH, Combo, RunResult, series, window_size

COLLAPSE = 0.1
SPIKE = 5.0
ENTROPY_KEPT = 0.1
MAX_SEEDS = 10_000  # the largest number of seeds an estimate names


@dataclass(frozen=True)
class Criterion:
    key: str
    label: str
    floor: float  # the smallest difference between modes that counts, whatever the seeds say
    limit: float  # a run above it is flagged
    flag: str  # what a flagged run had
    form: str  # how a value is written
    counted: bool = False  # each run's value is 1 (flagged) or 0, shown as a count of runs

    def show(self, value: float) -> str:
        return self.form.format(value)


REWARD_DROP = Criterion("reward_drop", "reward drop", 0.02, COLLAPSE, "reward collapse", "{:.2f}")
GRAD_PEAK = Criterion("grad_peak", "grad-norm peak", 1.0, SPIKE, "grad-norm spike", "{:.1f}×")
ENTROPY_COLLAPSE = Criterion("entropy_collapse", "entropy collapse", 0.0, 0.5, "entropy collapse", "{:.0%}", True)
CRITERIA = (REWARD_DROP, GRAD_PEAK, ENTROPY_COLLAPSE)
ENTROPY_LEFT = "entropy_left"  # the share of the first window's entropy the last window kept (shown)

# two-sided 95%: Student's t at 1..30 degrees of freedom, then at 40, 60 and 120
_T_SMALL: tuple[float, ...] = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
)
_T_SMALL += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_T_LARGE = ((120, 1.980), (60, 2.000), (40, 2.021))


def t_95(df: int) -> float:
    """Student's t 97.5% point; between tabulated degrees of freedom, the lower one's (larger t)."""
    if df <= len(_T_SMALL):
        return _T_SMALL[df - 1]
    return next((t for at, t in _T_LARGE if df >= at), _T_SMALL[-1])


def judgeable(steps: int) -> bool:
    return steps >= 2 * window_size(steps)


# ----------------------------------------------------------------------------- one run
def run_numbers(rows: list[dict], window: int) -> dict[str, float | None]:
    """The three numbers of one run and the entropy it kept; None where it did not log the
    metric, or logged fewer than two windows of it."""
    rewards, grads, entropy = (series(rows, key) for key in ("reward/mean", "train/grad_norm", "train/entropy"))
    out: dict[str, float | None] = dict.fromkeys([*(c.key for c in CRITERIA), ENTROPY_LEFT])
    if len(rewards) >= 2 * window:
        windows = [statistics.fmean(rewards[i : i + window]) for i in range(len(rewards) - window + 1)]
        out[REWARD_DROP.key] = max(windows) - windows[-1]
    if len(grads) >= 2 * window and statistics.median(grads) > 0:
        out[GRAD_PEAK.key] = max(grads[window:]) / statistics.median(grads)
    if len(entropy) >= 2 * window and statistics.fmean(entropy[:window]) > 0:
        left = statistics.fmean(entropy[-window:]) / statistics.fmean(entropy[:window])
        out[ENTROPY_LEFT], out[ENTROPY_COLLAPSE.key] = left, float(left < ENTROPY_KEPT)
    return out


def collapsed_seeds(runs: list[RunResult], window: int) -> int:
    """Runs whose reward collapsed (last window more than COLLAPSE below the best window)."""
    drops = (run_numbers(r.rows, window)[REWARD_DROP.key] for r in runs)
    return sum(d is not None and d > COLLAPSE for d in drops)


@dataclass
class ModeNumbers:
    """One Combo over its seeds: each criterion's values (the seeds that could be judged on
    it), and what is shown beside them."""

    combo: Combo
    seeds: int
    values: dict[str, list[float]]
    entropy_left: list[float]
    reward_first: list[float]
    reward_last: list[float]
    mismatch_last: list[float]  # reported, never ranked
    natural_agreement: float | None  # learner's natural routing vs engine's, mean over steps and seeds
    used_agreement: float | None  # routing the learner used vs engine's

    def flagged(self, criterion: Criterion) -> int:
        return sum(v > criterion.limit for v in self.values[criterion.key])


def _mean_or_none(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def mode_numbers(runs: list[RunResult], window: int) -> ModeNumbers:
    numbers = [run_numbers(r.rows, window) for r in runs]
    rewards = [series(r.rows, "reward/mean") for r in runs]
    mismatch = [series(r.rows, MISMATCH) for r in runs]
    natural = [series(r.rows, ENGINE_AGREEMENT) for r in runs]
    used = [series(r.rows, f"{ENGINE_AGREEMENT}_used") for r in runs]
    return ModeNumbers(
        combo=runs[0].combo,
        seeds=len(runs),
        values={c.key: [v for n in numbers if (v := n[c.key]) is not None] for c in CRITERIA},
        entropy_left=[v for n in numbers if (v := n[ENTROPY_LEFT]) is not None],
        reward_first=[statistics.fmean(s[:window]) for s in rewards if s],
        reward_last=[statistics.fmean(s[-window:]) for s in rewards if s],
        mismatch_last=[statistics.fmean(s[-window:]) for s in mismatch if s],
        natural_agreement=_mean_or_none([statistics.fmean(s) for s in natural if s]),
        used_agreement=_mean_or_none([statistics.fmean(s) for s in used if s]),
    )


# ----------------------------------------------------------------------------- two modes
@dataclass(frozen=True)
class Gap:
    """mean(a) − mean(b), the smallest |difference| the rule counts (infinite with fewer than
    two values a side), and the seeds per side that would resolve it at the spread observed
    (None: the spread is unknown, or the difference is within the floor; MAX_SEEDS + 1: more
    than MAX_SEEDS)."""

    diff: float
    needed: float
    seeds: int | None

    @property
    def resolved(self) -> bool:
        return abs(self.diff) > self.needed


def gap(a: list[float], b: list[float], floor: float) -> Gap:
    diff = statistics.fmean(a) - statistics.fmean(b) if a and b else 0.0
    if len(a) < 2 or len(b) < 2:
        return Gap(diff, math.inf, None)
    spread = statistics.variance(a) + statistics.variance(b)
    needed = max(
        floor, t_95(len(a) + len(b) - 2) * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    )
    if abs(diff) <= floor:
        return Gap(diff, needed, None)
    seeds = next((n for n in range(2, MAX_SEEDS + 1) if t_95(2 * n - 2) * math.sqrt(spread / n) < abs(diff)), None)
    return Gap(diff, needed, seeds or MAX_SEEDS + 1)


@dataclass
class Pair:
    """Two modes on every criterion: where each was lower beyond the spread."""

    a: ModeNumbers
    b: ModeNumbers
    gaps: dict[str, Gap]

    def other(self, side: ModeNumbers) -> ModeNumbers:
        return self.b if side is self.a else self.a

    def lower(self, side: ModeNumbers) -> list[Criterion]:
        sign = -1 if side is self.a else 1
        return [c for c in CRITERIA if self.gaps[c.key].resolved and sign * self.gaps[c.key].diff > 0]

    def more_stable(self) -> ModeNumbers | None:
        a, b = self.lower(self.a), self.lower(self.b)
        return self.a if a and not b else self.b if b and not a else None


# ----------------------------------------------------------------------------- a group
@dataclass
class Verdict:
    """The modes of one algorithm, off-policy degree and variant, compared."""

    modes: list[ModeNumbers]
    steps: int
    window: int
    pairs: list[Pair]
    winner: ModeNumbers | None
    blockers: list[str]  # why nothing can be told apart, before any number is compared

    def closest(self) -> tuple[Pair, Criterion] | None:
        """The unresolved difference that the fewest seeds would resolve at the spread observed."""
        open_ = [
            (p, c)
            for p in self.pairs
            for c in CRITERIA
            if not p.gaps[c.key].resolved and p.gaps[c.key].seeds is not None
        ]
        return min(open_, key=lambda pc: pc[0].gaps[pc[1].key].seeds or 0, default=None)


def judge(modes: list[ModeNumbers], steps: int) -> Verdict:
    window = window_size(steps)
    blockers = []
    if len(modes) < 2:
        blockers.append("only one mode ran")
    if not judgeable(steps):
        blockers.append(
            f"runs of {steps} steps are shorter than two {window}-step windows, so no reward collapse, "
            "grad-norm spike or entropy collapse can be judged"
        )
    if any(m.seeds < 2 for m in modes):
        blockers.append(
            "one seed of a mode leaves the spread between seeds unknown, so no difference can be told from "
            "noise (--seeds 3 measures it)"
        )
    pairs = [
        Pair(a, b, {c.key: gap(a.values[c.key], b.values[c.key], c.floor) for c in CRITERIA})
        for a, b in itertools.combinations(modes, 2)
    ]
    winner = None
    if not blockers:
        winner = next(
            (m for m in modes if all(p.more_stable() is m for p in pairs if m in (p.a, p.b))),
            None,
        )
    return Verdict(modes, steps, window, pairs, winner, blockers)
