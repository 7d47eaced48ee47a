"""Prompt skipping (GRESO, buffer.skip_prompts) off against on, side by side: the same command
and seed run twice through the `megatron-rlvr train` CLI, skipping off and on, the pairs
interleaved (off, on for the first seed; on, off for the next, so a machine that slows down
during the benchmark does not favour one side).

Two runs:
- polarising: `launch.mode=local rollout.num_engines=2 buffer.batch_groups=4
  rollout.n_samples_per_prompt=4`, where with 4 samples most prompts soon give all-right or
  all-wrong groups (the case skipping is for);
- default: configs/tiny-moe-cpu.yaml as the README runs it (decides the default).

Per run: groups generated per group trained on (lower is better), wall time of the whole
command, mean reward of the last 20 steps, the first step whose 10-step mean reward reaches
0.9, prompts skipped, and the last evaluation's avg@n when the config evaluates.

    .venv/bin/python benchmarks/greso.py [--runs polarising default] [--seeds 0 1]
                                          [--polarising-steps 80] [--default-steps 120] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-moe-cpu.yaml"
POLARISING = ["launch.mode=local", "rollout.num_engines=2", "buffer.batch_groups=4", "rollout.n_samples_per_prompt=4"]
LAST, WINDOW, TARGET = 20, 10, 0.9


@dataclass
class Result:
    run: str
    seed: int
    skipping: bool
    steps: int
    generated_per_used: float
    wall_s: float
    last_reward: float
    step_to_target: int | None
    skipped: int
    eval_reward: float | None
    message: str = ""  # why the run ended early, if it did


def summarise(run: str, seed: int, skipping: bool, rows: list[dict], wall_s: float, message: str = "") -> Result:
    """One run's figures from its metrics.jsonl rows (one per step, in order)."""
    rewards = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    last = [v for _, v in rewards[-LAST:]]
    step_to_target = next(
        (
            rewards[i][0]
            for i in range(WINDOW - 1, len(rewards))
            if statistics.fmean(v for _, v in rewards[i - WINDOW + 1 : i + 1]) >= TARGET
        ),
        None,
    )
    evals = [r for r in rows if any(k.startswith("eval/") and "/avg@" in k for k in r)]
    eval_reward = None
    if evals:
        values = [v for k, v in evals[-1].items() if k.startswith("eval/") and "/avg@" in k]
        eval_reward = statistics.fmean(values)
    final = rows[-1] if rows else {}
    used = final.get("buffer/used", 0)
    return Result(
        run,
        seed,
        skipping,
        len(rows),
        final.get("buffer/generated", 0) / used if used else float("inf"),
        wall_s,
        statistics.fmean(last) if last else float("nan"),
        step_to_target,
        sum(r.get("sampler/skipped_prompts", 0) for r in rows),
        eval_reward,
        message,
    )


def train(run: str, seed: int, skipping: bool, overrides: list[str], attempts: int = 2) -> Result:
    """One run through the CLI; a run that fails (an engine port taken by another process
    between its choice and its use, say) is started again from scratch, once."""
    for attempt in range(1, attempts + 1):
        try:
            return _train_once(run, seed, skipping, overrides)
        except RuntimeError as err:
            if attempt == attempts:
                raise SystemExit(str(err)) from err
            print(f"{err}\nstarting it again", flush=True)


def _train_once(run: str, seed: int, skipping: bool, overrides: list[str]) -> Result:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "train",
            str(CONFIG),
            *overrides,
            f"trainer.seed={seed}",
            f"buffer.skip_prompts.enabled={str(skipping).lower()}",
            f"trainer.output_dir={out}",
            "logging.tensorboard=false",
        ]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(
                f"{run} seed {seed} skipping {skipping}: exit {done.returncode}: "
                f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}"
            )
        metrics = Path(out) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    ended = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "nothing left to learn" in line]
    return summarise(run, seed, skipping, rows, wall_s, ended[-1] if ended else "")


def table(results: list[Result]) -> str:
    """The printed table, then one ratio line per (run, seed) pair: generated per used, off / on."""
    header = (
        f"{'run':<11} {'seed':>4} {'skip':>4} {'steps':>5} {'gen/used':>8} {'wall s':>7} "
        f"{'last-20 reward':>14} {'step to ' + str(TARGET):>11} {'skipped':>7} {'eval':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.run:<11} {r.seed:>4} {'on' if r.skipping else 'off':>4} {r.steps:>5} "
            f"{r.generated_per_used:>8.2f} {r.wall_s:>7.0f} {r.last_reward:>14.3f} "
            f"{r.step_to_target if r.step_to_target is not None else '-':>11} {r.skipped:>7} "
            f"{f'{r.eval_reward:.3f}' if r.eval_reward is not None else '-':>6}"
        )
        if r.message:
            lines.append(f"  ended early: {r.message}")
    pairs: dict[tuple[str, int], dict[bool, Result]] = {}
    for r in results:
        pairs.setdefault((r.run, r.seed), {})[r.skipping] = r
    for (run, seed), pair in pairs.items():
        if len(pair) == 2:
            off, on = pair[False], pair[True]
            lines.append(
                f"ratio {run} seed {seed}: generated per used off/on {off.generated_per_used / on.generated_per_used:.2f}x, "
                f"wall off/on {off.wall_s / on.wall_s:.2f}x, last-20 reward {off.last_reward:.3f} -> {on.last_reward:.3f}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", choices=["polarising", "default"], default=["polarising", "default"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds of the polarising run")
    parser.add_argument("--polarising-steps", type=int, default=80)
    parser.add_argument("--default-steps", type=int, default=120, help="the README's run: 120")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, key=value")
    args = parser.parse_args()
    plan = []
    if "polarising" in args.runs:
        for i, seed in enumerate(args.seeds):
            order = (False, True) if i % 2 == 0 else (True, False)
            plan += [
                ("polarising", seed, skipping, [*POLARISING, f"trainer.steps={args.polarising_steps}"])
                for skipping in order
            ]
    if "default" in args.runs:
        plan += [("default", 0, skipping, [f"trainer.steps={args.default_steps}"]) for skipping in (False, True)]
    results = []
    for run, seed, skipping, overrides in plan:
        results.append(train(run, seed, skipping, [*overrides, *args.overrides]))
        r = results[-1]
        print(
            f"done: {run} seed {seed} skipping {'on' if skipping else 'off'}: gen/used {r.generated_per_used:.2f}, "
            f"{r.wall_s:.0f} s, last-20 reward {r.last_reward:.3f}",
            flush=True,
        )
    print(table(results))


if __name__ == "__main__":
    main()
