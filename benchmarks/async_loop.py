"""Throughput of the RL loop with generation for step k+1 overlapping the training of step k
(buffer.async_rollout) against the synchronous loop, on the same config and seed, one after
the other in this process. Throughput: samples trained per second of step time, first step
(start-up, cold caches) excluded.

    .venv/bin/python benchmarks/async_loop.py [--steps 30] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from megatron_rlvr.config import load_config
from megatron_rlvr.trainer import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-moe-cpu.yaml"


def throughput(steps: int, overrides: list[str], overlap: bool) -> tuple[float, list[dict]]:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            str(CONFIG),
            [
                f"trainer.output_dir={out}",
                f"trainer.steps={steps}",
                "logging.tensorboard=false",
                f"buffer.async_rollout={overlap}",
                *overrides,
            ],
        )
        history = train(cfg).history
    samples = cfg.buffer.batch_groups * cfg.rollout.n_samples_per_prompt
    seconds = sum(m["time/step_s"] for m in history[1:])
    return samples * (len(history) - 1) / seconds, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    results = {}
    for name, overlap in (("sync", False), ("async", True)):
        rate, history = throughput(args.steps, args.overrides, overlap)
        stale = history[-1]["buffer/dropped_stale"]
        reward = statistics.fmean(m["reward/mean"] for m in history[-5:] if "reward/mean" in m)
        results[name] = rate
        print(
            f"{name:>5}: {rate:8.1f} samples/s  median step {statistics.median(m['time/step_s'] for m in history[1:]):.2f} s"
            f"  reward (last 5) {reward:.3f}  dropped stale {stale}"
        )
    print(f"ratio: {results['async'] / results['sync']:.2f}")


if __name__ == "__main__":
    main()
