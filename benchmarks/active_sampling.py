"""Rollout cost of active sampling: prompt groups generated per group trained on, in a real
run of the tiny default (CPU engine, Megatron learner, verifier), against

- the optimum, 1 / useful fraction: every useful group generated is trained on, and
- fixed 3× over-sampling (generate 3·B groups per round, rounds until B are useful, throw the
  surplus away), costed on the useful fraction this same run measured at each step.

Surplus useful groups stay in the buffer for the next step, so ours loses only what goes
stale (older than buffer.max_staleness). Groups still waiting at the end count as used: a
longer run would take them.

    .venv/bin/python benchmarks/active_sampling.py [--steps 40] [key=value ...]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from megatron_rlvr.config import load_config
from megatron_rlvr.trainer import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-moe-cpu.yaml"


def fixed_oversampling_cost(useful_fraction: float, factor: int = 3) -> float:
    """Groups generated per used group when each round generates factor·B groups and rounds
    repeat until B are useful (expected rounds rounded up: partial rounds still run whole)."""
    if useful_fraction <= 0:
        return math.inf
    return factor * math.ceil(1.0 / (factor * useful_fraction))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            str(CONFIG),
            [f"trainer.output_dir={out}", f"trainer.steps={args.steps}", "logging.tensorboard=false", *args.overrides],
        )
        history = train(cfg).history
    batch = cfg.buffer.batch_groups
    print(f"{'step':>4} {'generated':>9} {'kept':>5} {'useful':>7} {'3x/used':>8}")
    previous = {"buffer/generated": 0, "buffer/kept_groups": 0}
    fixed_total, fraction = 0.0, 1.0
    for m in history:
        generated = m["buffer/generated"] - previous["buffer/generated"]
        kept = m["buffer/kept_groups"] - previous["buffer/kept_groups"]
        previous = m
        # a step ours fed from the buffer alone: 3× generates anyway, at the latest fraction
        fraction = kept / generated if generated else fraction
        cost = fixed_oversampling_cost(fraction)
        fixed_total += cost * batch
        print(f"{m['step']:>4} {generated:>9} {kept:>5} {fraction:>7.3f} {cost:>8.1f}")
    last = history[-1]
    generated, kept = last["buffer/generated"], last["buffer/kept_groups"]
    used = last["buffer/used"] + last["buffer/waiting"]
    ours, optimum = generated / used, generated / kept
    print(
        f"groups generated {generated}, kept {kept}, trained on {last['buffer/used']}, waiting "
        f"{last['buffer/waiting']}, dropped stale {last['buffer/dropped_stale']}"
    )
    print(
        f"generated per used group: ours {ours:.3f}  optimum {optimum:.3f}  "
        f"fixed 3x {fixed_total / (batch * len(history)):.3f}"
    )
    print(f"ratio: {ours / optimum:.3f}")


if __name__ == "__main__":
    main()
