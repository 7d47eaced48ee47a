"""Loop throughput with in-flight weight updates (rollout.updates = in_flight) against the
synchronous loop and the one-step asynchronous one (buffer.async_rollout), on the same config
and seeds, one after the other in this process. Throughput: response tokens generated per
second of step time, first step (start-up, cold caches) excluded; with each, the engines'
busy share, the mean staleness of the trained tokens and the reward of the last 5 steps.
Long answers (rollout.max_new_tokens = 96 by default) give the long tail that in-flight
generation is for. The last line is `ratio: X`, in-flight over synchronous tokens/s.

    .venv/bin/python benchmarks/in_flight.py [--steps 20] [--seeds 1] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from megatron_rlvr.config import load_config
from megatron_rlvr.trainer import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-moe-cpu.yaml"
MODES = {
    "sync": [],
    "async": ["buffer.async_rollout=true"],
    "in_flight": ["rollout.updates=in_flight", "weight_sync.pause_mode=in_place"],
}


def measure(steps: int, seed: int, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            str(CONFIG),
            [
                f"trainer.output_dir={out}",
                f"trainer.steps={steps}",
                f"trainer.seed={seed}",
                "logging.tensorboard=false",
                "rollout.max_new_tokens=96",
                "buffer.max_staleness=2",
                *overrides,
            ],
        )
        history = train(cfg).history[1:]
    rewards = [m["reward/mean"] for m in history[-5:] if "reward/mean" in m]
    return {
        "tokens_per_s": sum(m["rollout/tokens"] for m in history) / sum(m["time/step_s"] for m in history),
        "engine_busy": statistics.fmean(m["loop/engine_busy_fraction"] for m in history),
        "staleness": statistics.fmean(m.get("staleness/mean", 0.0) for m in history),
        "reward": statistics.fmean(rewards) if rewards else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run (the first is not timed)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per mode (the whole table: 3)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    rates = {}
    for name, mode in MODES.items():
        runs = [measure(args.steps, seed, mode + args.overrides) for seed in range(args.seeds)]
        mean = {key: statistics.fmean(run[key] for run in runs) for key in runs[0]}
        rates[name] = mean["tokens_per_s"]
        print(
            f"{name:>9}: {mean['tokens_per_s']:8.1f} tokens/s  engine busy {mean['engine_busy']:.2f}"
            f"  staleness {mean['staleness']:.2f}  reward (last 5) {mean['reward']:.3f}"
        )
    print(f"ratio: {rates['in_flight'] / rates['sync']:.2f}")


if __name__ == "__main__":
    main()
