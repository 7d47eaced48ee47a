"""Routing replay on the long-answer task: none / R2 / R3 × GRPO / GSPO × off-policy 1, 2, 4, 8
(algo.num_minibatches), the engine in bfloat16 and the learner in float32, from an 8-expert
cold start (configs/compare-replay-long-cpu.yaml), plus GRPO on-policy without the
train-inference correction; then a verdict on each finding of Zheng et al. 2025 ("Stabilizing
RL with LLMs"), by the rules in `verdicts()` on compare-replay's (compare/verdict.py: reward
collapse, and one cell beating another beyond the seeds' spread):
  (a) on-policy, dropping the train-inference IS correction hurts;
  (b) at 2× off-policy, R2 is best;
  (c) at 4-8× off-policy, R3 is best and R2 fails;
  (d) GSPO without replay holds where GRPO without replay does not.
Each degree is one `megatron-rlvr compare-replay` (it resumes); degrees run 1, 8, 2, 4 so that a
short session still has both ends. --parts runs some of them, so that the grid can be split
between processes, e.g. two on 2 cores, each pinned to its own core by launch.* overrides (not
timed against one process on both cores).

    .venv/bin/megatron-rlvr sft configs/long-answers-sft-cpu.yaml model.num_experts=8 trainer.output_dir=runs/long-answers-sft-e8
    .venv/bin/python benchmarks/compare_replay_long.py runs/long-answers-sft-e8/hf [--steps 16] [--seeds 3] [--out runs/compare-replay-long] [--parts k1,k8] [key=value ...]

Ends with `findings reproduced: X of 4 (Y not reproduced, Z inconclusive)`; --report-only reads
the runs finished so far.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from megatron_rlvr import cli
from megatron_rlvr.compare import analysis as an
from megatron_rlvr.compare import command as compare_replay
from megatron_rlvr.compare import verdict as vd
from megatron_rlvr.compare.plan import DONE
from megatron_rlvr.compare.report import seeds_pm as pm
from megatron_rlvr.stopping import StopSignals

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "compare-replay-long-cpu.yaml"
GRID = ["--modes", "none,r2,r3", "--algos", "grpo,gspo"]
PARTS = {  # folder → compare-replay arguments
    "k1": [*GRID, "--off-policy", "1"],
    "k1-no-is": ["--modes", "none", "--algos", "grpo", "--off-policy", "1", "algo.rollout_correction.rollout_is=null"],
    "k8": [*GRID, "--off-policy", "8"],
    "k2": [*GRID, "--off-policy", "2"],
    "k4": [*GRID, "--off-policy", "4"],
}
PASS1 = "eval/heldout/pass@1"
REWARD = "reward/mean"
MIN_MARGIN = vd.REWARD_DROP.floor  # rewards closer than this are equal, whatever the seeds' spread


class Cell:
    """One (part, algo, degree, mode) over its finished seeds: last-window reward, collapses,
    held-out pass@1 at the end, mismatch KL."""

    def __init__(self, runs: list[an.RunResult], steps: int):
        window = an.window_size(steps)
        for run in runs:
            an.summarise(run, [REWARD, an.MISMATCH], window)
        self.seeds = len(runs)
        self.rewards = [r.summaries[REWARD].last for r in runs if REWARD in r.summaries]
        self.first = [r.summaries[REWARD].first for r in runs if REWARD in r.summaries]
        self.pass1 = [an.series(r.rows, PASS1)[-1] for r in runs if an.series(r.rows, PASS1)]
        self.kl = [r.summaries[an.MISMATCH].mean for r in runs if an.MISMATCH in r.summaries]
        self.collapses = vd.collapsed_seeds(runs, window)

    @property
    def failed(self) -> bool:
        """A majority of its seeds, two at least, collapsed by the comparison report's rule."""
        return self.seeds >= 2 and 2 * self.collapses > self.seeds

    def row(self) -> str:
        kl = f"{statistics.fmean(self.kl):.1e}" if self.kl else "–"
        return f"{pm(self.first)} → {pm(self.rewards)} | {self.collapses} of {self.seeds} | {pm(self.pass1)} | {kl}"


def better(a: Cell, b: Cell) -> bool:
    """a's last-window reward above b's beyond the seeds' spread, by compare-replay's rule
    (compare.verdict.gap: by more than MIN_MARGIN and Student's t times the standard error of the
    difference; two seeds each at least: one seed says nothing about noise)."""
    found = vd.gap(a.rewards, b.rewards, MIN_MARGIN)
    return found.resolved and found.diff > 0


def read_cells(out: Path, steps: int) -> dict[tuple[str, str, int, str], Cell]:
    """(part, algo, degree, mode) → Cell, from the finished runs compare-replay left."""
    found: dict[tuple[str, str, int, str], list[an.RunResult]] = {}
    for part in PARTS:
        for run in sorted((out / part / "runs").glob("*-s*")):
            if not (run / DONE).exists():
                continue
            algo, degree, mode, seed = run.name.split("-")  # grpo-k4-r3-s0 (no --vary here)
            combo = an.Combo(algo, int(degree[1:]), mode)
            result = an.RunResult(combo, int(seed[1:]), an.read_metrics(run / "metrics.jsonl"))
            found.setdefault((part, algo, combo.off_policy, mode), []).append(result)
    return {key: Cell(runs, steps) for key, runs in found.items()}


def verdicts(cells: dict[tuple[str, str, int, str], Cell]) -> dict[str, tuple[str, str]]:
    """finding → (reproduced | not reproduced | inconclusive, the numbers behind it)."""
    empty = Cell([], 1)

    def cell(algo: str, k: int, mode: str, part: str | None = None) -> Cell:
        return cells.get((part or f"k{k}", algo, k, mode), empty)

    def say(*named: tuple[str, Cell]) -> str:
        return "; ".join(f"{name}: reward {pm(c.rewards)}, collapsed {c.collapses} of {c.seeds}" for name, c in named)

    out = {}
    with_is, without = cell("grpo", 1, "none"), cell("grpo", 1, "none", "k1-no-is")
    if better(with_is, without) or (without.failed and not with_is.failed):
        out["a"] = "reproduced"
    elif better(without, with_is) or (with_is.failed and not without.failed):
        out["a"] = "not reproduced"
    else:
        out["a"] = "inconclusive"
    out["a"] = (out["a"], say(("token TIS", with_is), ("no correction", without)))

    none2, r2, r3 = (cell("grpo", 2, m) for m in ("none", "r2", "r3"))
    if better(r2, none2) and better(r2, r3):
        verdict = "reproduced"
    else:
        verdict = "not reproduced" if better(none2, r2) or better(r3, r2) else "inconclusive"
    out["b"] = (verdict, say(("none", none2), ("R2", r2), ("R3", r3)))

    results = []
    for k in (4, 8):
        none_k, r2_k, r3_k = (cell("grpo", k, m) for m in ("none", "r2", "r3"))
        if better(r3_k, r2_k) and better(r3_k, none_k) and r2_k.failed:
            results.append("reproduced")
        elif better(r2_k, r3_k) or (r2_k.collapses == 0 and r2_k.seeds >= 2 and not better(r3_k, r2_k)):
            results.append("not reproduced")
        else:
            results.append("inconclusive")
    verdict = (
        results[0] if len(set(results)) == 1 else ("not reproduced" if "not reproduced" in results else "inconclusive")
    )
    out["c"] = (
        verdict,
        " | ".join(f"{k}×: " + say(*((m, cell("grpo", k, m)) for m in ("none", "r2", "r3"))) for k in (4, 8)),
    )

    grpo_fails = [k for k in (1, 2, 4, 8) if cell("grpo", k, "none").failed]
    if not grpo_fails:
        verdict = "inconclusive"  # nothing for GSPO to hold where GRPO does not
    elif any(cell("gspo", k, "none").failed or cell("gspo", k, "none").seeds < 2 for k in grpo_fails):
        verdict = "not reproduced" if any(cell("gspo", k, "none").failed for k in grpo_fails) else "inconclusive"
    else:
        verdict = "reproduced"
    out["d"] = (
        verdict,
        " | ".join(
            f"{k}×: " + say(("GRPO", cell("grpo", k, "none")), ("GSPO", cell("gspo", k, "none"))) for k in (1, 2, 4, 8)
        ),
    )
    return out


FINDINGS = {
    "a": "on-policy, dropping the train-inference IS correction hurts",
    "b": "at 2× off-policy, R2 is best",
    "c": "at 4-8× off-policy, R3 is best and R2 fails",
    "d": "GSPO without replay holds where GRPO without replay does not",
}


def report(out: Path, steps: int) -> None:
    cells = read_cells(out, steps)
    print("| algo | off-policy | mode | reward, first → last window | collapsed | held-out pass@1 | mismatch KL |")
    print("|---|---|---|---|---|---|---|")
    for (part, algo, k, mode), c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0], kv[0][3])):
        label = f"{mode}, no correction" if part.endswith("no-is") else mode
        print(f"| {algo} | {k}× | {label} | {c.row()} |")
    found = verdicts(cells)
    for key, (verdict, numbers) in found.items():
        print(f"({key}) {FINDINGS[key]}: {verdict.upper()} — {numbers}")
    counts = [v for v, _ in found.values()]
    print(
        f"findings reproduced: {counts.count('reproduced')} of 4 "
        f"({counts.count('not reproduced')} not reproduced, {counts.count('inconclusive')} inconclusive)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the 8-expert cold start's HF folder (sft.export_dir)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="runs/compare-replay-long")
    parser.add_argument("--report-only", action="store_true", help="the table of the runs already finished")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)} to run (default all)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, key=value")
    args = parser.parse_intermixed_args()  # overrides may follow the options
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"--parts: unknown {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    out = Path(args.out).absolute()
    if not args.report_only:
        stop = StopSignals().install()
        for part in parts:
            argv = ["compare-replay", str(CONFIG), "--steps", str(args.steps), "--seeds", str(args.seeds)]
            argv += ["--out", str(out / part), f"model.path={args.model}", *args.overrides, *PARTS[part]]
            if stop.requested or compare_replay.main(cli.parse_args(argv), stop):
                raise SystemExit(f"stopped in {part}; the same command resumes")
    report(out, args.steps)


if __name__ == "__main__":
    main()
