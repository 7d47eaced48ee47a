"""From the runs' metrics.jsonl to numbers: per-run summaries (mean over all steps, first and
last window), seeds aggregated as mean ± std, and the stability verdict per algorithm,
off-policy degree and --vary variant. Plain Python, no torch: it can run on a laptop over copied-back runs.

The verdict rule is explicit so that the report can state it and a reader can check it:
  1. a run is disqualified by a reward collapse (its last-window reward more than
     COLLAPSE below its best window) or a grad-norm spike (a step after the first window
     above SPIKE × the run's median grad norm: the first steps from random weights are
     atypical everywhere);
  2. of the rest (all runs, if every one is disqualified), the most stable has the lowest
     last-window train/inference mismatch KL (k3 KL between rollout and learner logprobs):
     that KL is what routing replay exists to keep down, and it ends high both when it starts
     high and when it grows.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr.compare.variants import NO_VARIANT, Variant

COLLAPSE = 0.1
SPIKE = 5.0
MISMATCH = "train/mismatch_k3_kl"
ENGINE_AGREEMENT = "train/routing_agreement_engine"

# (metrics.jsonl key, label): what the table and plots show, in this order. Per-layer engine
# agreement keys are added after their overall key when a run logged them.
METRICS = (
    ("reward/mean", "reward"),
    ("train/policy_loss", "policy loss"),
    ("train/clipfrac", "clip fraction"),
    ("train/clipfrac_low_side", "clip fraction, ratio < 1"),
    ("train/clipfrac_high_side", "clip fraction, ratio > 1"),
    ("train/rollout_is_mean", "correction weight π_old/μ, mean (rollout_is)"),
    ("train/rollout_is_max", "correction weight π_old/μ, max"),
    ("train/rollout_is_clipfrac", "tokens whose correction weight was bounded"),
    ("train/rollout_rs_masked_fraction", "tokens rejected (rollout_rs)"),
    ("train/approx_kl", "KL old → current policy (k3)"),
    ("train/mismatch_abs_mean", "mismatch mean |Δlogp| rollout vs learner"),
    ("train/mismatch_abs_max", "mismatch max |Δlogp| rollout vs learner"),
    (MISMATCH, "mismatch KL rollout → learner (k3)"),
    (ENGINE_AGREEMENT, "routing agreement, learner's natural vs engine's"),
    (f"{ENGINE_AGREEMENT}_used", "routing agreement, learner's used vs engine's"),
    ("train/routing_agreement", "routing agreement, natural vs replayed (training)"),
    ("train/grad_norm", "grad norm"),
    ("time/step_s", "step time (s)"),
)


@dataclass(frozen=True, order=True)
class Combo:
    """One cell of the comparison; a run is a Combo and a seed."""

    algo: str
    off_policy: int
    mode: str
    variant: Variant = NO_VARIANT

    @property
    def group(self) -> tuple[str, int, Variant]:
        """What a verdict holds fixed while it compares modes: algorithm, degree and variant."""
        return self.algo, self.off_policy, self.variant

    def label(self) -> str:
        varied = f" ({self.variant.label})" if self.variant.settings else ""
        return f"{self.algo} {self.off_policy}× {self.mode}{varied}"


@dataclass
class Summary:
    """One metric of one run: mean over all steps, first- and last-window means, maximum."""

    mean: float
    first: float
    last: float
    peak: float


@dataclass
class RunResult:
    combo: Combo
    seed: int
    rows: list[dict]
    summaries: dict[str, Summary] = field(default_factory=dict)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metric_keys(results: list[RunResult]) -> list[tuple[str, str]]:
    """METRICS that any run logged, per-layer engine agreement after its overall key."""
    logged = {key for r in results for row in r.rows for key in row}
    keys = []
    for key, label in METRICS:
        if key in logged:
            keys.append((key, label))
        if key == ENGINE_AGREEMENT:
            layers = sorted(
                (k for k in logged if k.startswith(f"{key}/layer")), key=lambda k: int(k.rsplit("layer", 1)[1])
            )
            keys += [(k, f"routing agreement with engine, layer {k.rsplit('layer', 1)[1]}") for k in layers]
    return keys


def window_size(steps: int) -> int:
    """Steps in the first and last windows: a fifth of the run, at least one."""
    return max(1, steps // 5)


def series(rows: list[dict], key: str) -> list[float]:
    return [row[key] for row in rows if isinstance(row.get(key), (int, float))]


def summarise(result: RunResult, keys: list[str], window: int) -> RunResult:
    for key in keys:
        values = series(result.rows, key)
        if values:
            result.summaries[key] = Summary(
                statistics.fmean(values),
                statistics.fmean(values[:window]),
                statistics.fmean(values[-window:]),
                max(values),
            )
    return result


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class Cell:
    """A metric of one Combo over its seeds: (mean, std) of each run's mean and last window."""

    mean: tuple[float, float]
    last: tuple[float, float]


def aggregate(results: list[RunResult], keys: list[str]) -> dict[Combo, dict[str, Cell]]:
    table: dict[Combo, dict[str, Cell]] = {}
    for combo in sorted({r.combo for r in results}):
        runs = [r for r in results if r.combo == combo]
        table[combo] = {
            key: Cell(
                mean_std([r.summaries[key].mean for r in runs if key in r.summaries]),
                mean_std([r.summaries[key].last for r in runs if key in r.summaries]),
            )
            for key in keys
            if any(key in r.summaries for r in runs)
        }
    return table


def mean_curve(results: list[RunResult], combo: Combo, key: str) -> tuple[list[int], list[float], list[float]]:
    """Steps, mean over seeds and std over seeds of one metric (steps every seed logged)."""
    runs = [r for r in results if r.combo == combo]
    per_step: dict[int, list[float]] = {}
    for r in runs:
        for row in r.rows:
            if isinstance(row.get(key), (int, float)):
                per_step.setdefault(row["step"], []).append(row[key])
    steps = [s for s in sorted(per_step) if len(per_step[s]) == len(runs)]
    stats = [mean_std(per_step[s]) for s in steps]
    return steps, [m for m, _ in stats], [sd for _, sd in stats]


# ----------------------------------------------------------------------------- stability
@dataclass
class Stability:
    """The numbers behind one Combo's verdict (over its seeds)."""

    combo: Combo
    mismatch_first: float
    mismatch_last: float
    mismatch_peak: float
    collapses: int  # seeds whose reward collapsed
    spikes: int  # grad-norm spike steps, over all seeds
    spike_ratio: float  # the largest grad norm after the first window over its run's median
    reward_first: float
    reward_last: float
    natural_agreement: float | None  # learner's natural routing vs engine's, mean over steps
    used_agreement: float | None  # routing the learner used vs engine's

    @property
    def growth(self) -> float:
        return self.mismatch_last / self.mismatch_first if self.mismatch_first > 0 else float("inf")

    @property
    def disqualified(self) -> bool:
        return bool(self.collapses or self.spikes)


def _collapsed(rewards: list[float], window: int) -> bool:
    if len(rewards) < window:
        return False
    windows = [statistics.fmean(rewards[i : i + window]) for i in range(len(rewards) - window + 1)]
    return windows[-1] < max(windows) - COLLAPSE


def _spikes(grad_norms: list[float], window: int) -> tuple[int, float]:
    """(spike steps, largest grad norm over the median), both after the first window."""
    later = grad_norms[window:]
    median = statistics.median(grad_norms) if grad_norms else 0.0
    if not later or median <= 0:
        return 0, 0.0
    return sum(g > SPIKE * median for g in later), max(later) / median


def stability(results: list[RunResult], combo: Combo, window: int) -> Stability:
    runs = [r for r in results if r.combo == combo]
    spikes = [_spikes(series(r.rows, "train/grad_norm"), window) for r in runs]

    def seed_mean(key: str, part: str) -> float | None:
        values = [getattr(r.summaries[key], part) for r in runs if key in r.summaries]
        return statistics.fmean(values) if values else None

    return Stability(
        combo=combo,
        mismatch_first=seed_mean(MISMATCH, "first") or 0.0,
        mismatch_last=seed_mean(MISMATCH, "last") or 0.0,
        mismatch_peak=seed_mean(MISMATCH, "peak") or 0.0,
        collapses=sum(_collapsed(series(r.rows, "reward/mean"), window) for r in runs),
        spikes=sum(n for n, _ in spikes),
        spike_ratio=max(ratio for _, ratio in spikes),
        reward_first=seed_mean("reward/mean", "first") or 0.0,
        reward_last=seed_mean("reward/mean", "last") or 0.0,
        natural_agreement=seed_mean(ENGINE_AGREEMENT, "mean"),
        used_agreement=seed_mean(f"{ENGINE_AGREEMENT}_used", "mean"),
    )


def most_stable(candidates: list[Stability]) -> Stability:
    """The rule in this module's docstring."""
    eligible = [s for s in candidates if not s.disqualified] or candidates
    return min(eligible, key=lambda s: s.mismatch_last)
