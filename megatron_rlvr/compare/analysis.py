"""From the runs' metrics.jsonl to numbers: per-run summaries (mean over all steps, first and
last window), seeds aggregated as mean ± std, and seed-mean curves. Plain Python, no torch: it
can run on a laptop over copied-back runs. The stability verdict built on them: verdict.py."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr.compare.variants import NO_VARIANT, Variant

MIN_WINDOW = 3
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
    ("train/entropy", "policy entropy on the sampled tokens"),
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
    """Steps in the first and last windows: a fifth of the run, MIN_WINDOW at least (so that one
    noisy step neither makes nor hides a collapse), the whole run at most."""
    return min(steps, max(MIN_WINDOW, steps // 5))


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
