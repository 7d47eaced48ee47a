"""Loop throughput with in-flight weight updates (rollout.updates = in_flight) against the
synchronous loop and the one-step asynchronous one (buffer.async_rollout), on the long-answer
task (configs/long-answers-cpu.yaml: GRPO from the SFT cold start), the same seeds, one mode
after the other in this process, the learner and the engine pinned to separate cores
(launch.learner_cpus: the first half of this process's cores, launch.engine_cpus: the rest),
as separate GPUs would be.

Per mode: loop tokens/s (response tokens generated over step time, the first step excluded:
start-up), the engine's idle share (1 - loop/engine_busy_fraction, mean over those steps: no
request running, or the engine paused for a weight sync), the engine's own rate (tokens per
second it was generating: in flight can beat synchronous by at most this rate over synchronous
tokens/s), the weight sync's seconds a step, the learner's busy share, the mean training reward
per step, and held-out pass@1 (the config's eval set) after the last step. The last line is
`ratio: X`, in-flight over synchronous tokens/s.

The cold start must exist: `megatron-rlvr sft configs/long-answers-sft-cpu.yaml` writes
runs/long-answers-sft/hf; this script does not run it, so its own time is the modes' alone. A
plain run is one seed, the CPU engine, 16 steps of 8 groups of 8 up to 256 tokens (the config's
own batch). --full runs the whole table:
3 seeds, the CPU engine and real SGLang on CPU (.venv-sglang), held-out pass@1 every 4 steps,
and the step seconds until pass@1 first reaches the highest value every run reaches (the steps
right after an evaluation are not timed: generation went on during it). With evaluations a
second rate counts their time too: every step's tokens after the first over step and evaluation
seconds, what a user waits (async and in flight generate through an evaluation, which then takes
longer; docs/in-flight.md).

    .venv/bin/python benchmarks/in_flight.py [--cold-start DIR] [--steps 16] [--full] [--history DIR] [key=value ...]

--history DIR keeps each run's per-step metrics (DIR/<engine>-<mode>-seed<N>.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from megatron_rlvr.config import load_config
from megatron_rlvr.trainer import train

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "long-answers-cpu.yaml"
MODES = {
    "sync": [],
    "async": ["buffer.async_rollout=true"],
    "in_flight": ["rollout.updates=in_flight"],
}
# the pause each engine keeps its in-flight sequences through (docs/in-flight.md, "Which pause mode")
ENGINES = {
    "cpu": ["rollout.engine.type=cpu", "weight_sync.pause_mode=in_place"],
    "sglang": [
        "rollout.engine.type=sglang",
        "rollout.engine.device=cpu",
        f"rollout.engine.python={REPO / '.venv-sglang' / 'bin' / 'python'}",
        "rollout.engine.dtype=float32",
        "weight_sync.pause_mode=retract",
    ],
}
PASS = "eval/heldout/pass@1"


def core_split() -> list[str]:
    """The learner on the first half of this process's cores, the engine on the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit(f"in_flight.py: needs 2 cores to pin the learner and the engine apart; this process has {cores}")
    half = len(cores) // 2
    return [f"launch.learner_cpus={cores[:half]}", f"launch.engine_cpus={cores[half:]}"]


def measure(cold_start: Path, steps: int, seed: int, eval_interval: int, overrides: list[str]) -> dict:
    """One run: its throughput, busy shares, rewards and held-out pass@1 per evaluation."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            str(CONFIG),
            [
                f"model.path={cold_start}",
                f"trainer.output_dir={out}",
                f"trainer.steps={steps}",
                f"trainer.seed={seed}",
                "trainer.save_interval=0",
                "logging.tensorboard=false",
                "buffer.max_staleness=2",
                f"eval.interval={eval_interval}",
                "eval.at_start=false",
                *overrides,
            ],
        )
        history = train(cfg).history
    # the first step starts everything up; a step after an evaluation was generated during it
    timed = [m for m in history[1:] if eval_interval == 0 or (m["step"] - 1) % eval_interval]
    elapsed, passes = 0.0, []
    for m in history:
        elapsed += m["time/step_s"]
        if PASS in m:
            passes.append((elapsed, m[PASS]))
    wall = sum(m["time/step_s"] + m.get("time/eval_s", 0.0) for m in history[1:])
    return {
        "tokens_per_s": sum(m["rollout/tokens"] for m in timed) / sum(m["time/step_s"] for m in timed),
        "tokens_per_wall_s": sum(m["rollout/tokens"] for m in history[1:]) / wall,
        "engine_idle": 1 - statistics.fmean(m["loop/engine_busy_fraction"] for m in timed),
        # the engine's own rate: tokens per second it was generating (a paused engine is idle)
        "engine_rate": sum(m["rollout/tokens"] for m in timed)
        / max(1e-9, sum(m["loop/engine_busy_fraction"] * m["time/step_s"] for m in timed)),
        "sync_s": statistics.fmean(m.get("weight_sync/seconds", 0.0) for m in timed),
        "learner_busy": statistics.fmean(m["loop/learner_busy_fraction"] for m in timed),
        "learner_s": statistics.fmean(m["loop/learner_busy_fraction"] * m["time/step_s"] for m in timed),
        "staleness": statistics.fmean(m.get("staleness/mean", 0.0) for m in timed),
        "rewards": [m.get("reward/mean", float("nan")) for m in history],
        "reward": statistics.fmean(m["reward/mean"] for m in history if "reward/mean" in m),
        "pass1": passes[-1][1],
        "passes": passes,  # (step seconds so far, pass@1) at each evaluation
        "history": history,
    }


def seconds_to(target: float, passes: list[tuple[float, float]]) -> float | None:
    return next((s for s, p in passes if p >= target - 1e-9), None)


def spread(values: list[float], digits: int = 2) -> str:
    """Mean, ± the standard deviation over seeds when there are several; – for none."""
    if not values:
        return "–"
    mean = statistics.fmean(values)
    return f"{mean:.{digits}f}" if len(values) < 2 else f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(engine: str, runs: dict[str, list[dict]]) -> float:
    """Prints one engine's rows (mean ± std over seeds); returns in-flight over sync tokens/s."""
    best = [max(p for _, p in run["passes"]) for mode_runs in runs.values() for run in mode_runs]
    target = min(best)  # the held-out pass@1 every run reaches at some evaluation
    curves = any(len(run["passes"]) > 1 for mode_runs in runs.values() for run in mode_runs)
    print(f"\nengine {engine}" + (f"; wall = step seconds until held-out pass@1 first reaches {target:.3f}" * curves))
    columns = ("tokens/s",) + ("tokens/s, evaluations counted",) * curves
    columns += ("engine idle", "engine tokens/busy s", "sync s/step", "learner busy", "learner s/step")
    columns += ("staleness", "reward/step", "pass@1")
    columns += ("wall to it",) * curves
    print("| mode | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    rate, wall_rate = {}, {}
    for mode, mode_runs in runs.items():
        rate[mode] = statistics.fmean(r["tokens_per_s"] for r in mode_runs)
        wall_rate[mode] = statistics.fmean(r["tokens_per_wall_s"] for r in mode_runs)
        walls = [seconds_to(target, r["passes"]) for r in mode_runs]
        cells = [spread([r["tokens_per_s"] for r in mode_runs], 0)]
        cells += [spread([r["tokens_per_wall_s"] for r in mode_runs], 0)] * curves
        cells += [spread([r["engine_idle"] for r in mode_runs]), spread([r["engine_rate"] for r in mode_runs], 0)]
        keys = ("sync_s", "learner_busy", "learner_s", "staleness", "reward", "pass1")
        cells += [spread([r[key] for r in mode_runs]) for key in keys]
        cells += [f"{spread([w for w in walls if w is not None], 0)} s"] * curves
        print(f"| {mode} | " + " | ".join(cells) + " |")
    for mode, mode_runs in runs.items():  # a step trained on the buffer's surplus alone scored nothing: –
        per_step = zip(*(r["rewards"] for r in mode_runs), strict=True)
        print(f"{mode:>9} reward per step: " + " ".join(spread([x for x in s if x == x]) for s in per_step))
    print(
        f"in-flight / sync {rate['in_flight'] / rate['sync']:.2f}, in-flight / async {rate['in_flight'] / rate['async']:.2f}"
    )
    idle = statistics.fmean(r["engine_idle"] for r in runs["sync"])
    own = {mode: statistics.fmean(r["engine_rate"] for r in mode_runs) for mode, mode_runs in runs.items()}
    print(  # never idle at the synchronous engine's rate: 1 / (1 - its idle share)
        f"bound at the synchronous engine's rate: {1 / max(1e-9, 1 - idle):.2f}; engine rate in flight / sync "
        f"{own['in_flight'] / own['sync']:.2f}"
    )
    if curves:
        print(
            f"evaluations' time counted: in-flight / sync {wall_rate['in_flight'] / wall_rate['sync']:.2f}, "
            f"in-flight / async {wall_rate['in_flight'] / wall_rate['async']:.2f}"
        )
    return rate["in_flight"] / rate["sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold-start", type=Path, default=REPO / "runs" / "long-answers-sft" / "hf")
    parser.add_argument("--steps", type=int, default=16, help="steps per run (the first is not timed)")
    parser.add_argument("--full", action="store_true", help="3 seeds, the CPU engine and real SGLang")
    parser.add_argument("--seeds", type=int, help="seeds per mode (default 1, with --full 3)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, help="default cpu, with --full cpu sglang")
    parser.add_argument("--history", type=Path, help="a folder for each run's per-step metrics (JSON lines)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    if not (args.cold_start / "config.json").exists():
        sys.exit(
            f"in_flight.py: no cold start at {args.cold_start}: run `megatron-rlvr sft configs/long-answers-sft-cpu.yaml` "
            "first (it writes runs/long-answers-sft/hf), or pass --cold-start DIR"
        )
    engines = args.engines or (list(ENGINES) if args.full else ["cpu"])
    seeds, interval = range(args.seeds or (3 if args.full else 1)), 4 if args.full else 0
    ratios, cores = {}, core_split()
    for engine in engines:
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for mode, extra in MODES.items():
            for seed in seeds:
                overrides = [*cores, *ENGINES[engine], *extra, *args.overrides]
                run = measure(args.cold_start.resolve(), args.steps, seed, interval, overrides)
                runs[mode].append(run)
                if args.history:
                    args.history.mkdir(parents=True, exist_ok=True)
                    lines = "".join(json.dumps(m) + "\n" for m in run["history"])
                    (args.history / f"{engine}-{mode}-seed{seed}.jsonl").write_text(lines)
                print(  # each run as it ends, so a cut-short table keeps what was measured
                    f"{engine} {mode} seed {seed}: {run['tokens_per_s']:.0f} tokens/s, engine idle "
                    f"{run['engine_idle']:.2f}, pass@1 "
                    + ", ".join(f"{p:.3f} after {t:.0f} s" for t, p in run["passes"]),
                    flush=True,
                )
        ratios[engine] = table(engine, runs)
    print(f"ratio: {ratios.get('cpu', ratios[engines[0]]):.2f}")


if __name__ == "__main__":
    main()
