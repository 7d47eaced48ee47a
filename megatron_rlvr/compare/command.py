"""`megatron-rlvr compare-replay`: the same training run under several routing-replay modes,
algorithms, off-policy degrees and algo settings (--vary), side by side, with a report of whether
one kept training more stable than the others beyond the spread between seeds (compare/verdict.py).

    megatron-rlvr compare-replay CONFIG [key=value ...] --modes none,r2,r3 [--algos grpo,gspo]
        [--off-policy 1,2,4] [--vary algo.KEY=V1,V2 ...] [--steps N] [--seeds K] [--out DIR]
        [--submit --nodes N ...]

Runs are resumable: the same command again skips finished runs. With --submit, each
unfinished run becomes one Slurm job; the same command with --submit again collects them and
writes the report once every run has finished. Imports no torch until a run starts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from megatron_rlvr.compare.plan import CompareError, RunPlan, plan_runs, run_lock
from megatron_rlvr.compare.variants import parse_vary
from megatron_rlvr.config import AlgoConfig, load_config
from megatron_rlvr.launch.slurm import add_job_options
from megatron_rlvr.plan.command import add_submit_flags
from megatron_rlvr.stopping import StopRequested, StopSignals

MODES = get_args(AlgoConfig.model_fields["routing_replay"].annotation)
ALGOS = get_args(AlgoConfig.model_fields["kind"].annotation)


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(allowed)}")
        return list(dict.fromkeys(items))

    return parse


def _degrees(text: str) -> list[int]:
    try:
        items = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        items = []
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers >= 1")
    return list(dict.fromkeys(items))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= 1")
    return int(text)


def add_parser(sub) -> None:
    cmd = sub.add_parser(
        "compare-replay",
        help="run routing-replay modes side by side and report whether one keeps MoE training more stable",
    )
    cmd.add_argument("config", help="YAML config, e.g. configs/compare-replay-cpu.yaml")
    cmd.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    cmd.set_defaults(takes_overrides=True)
    cmd.add_argument("--modes", type=_choices(MODES), default=list(MODES), help="default: none,r2,r3")
    cmd.add_argument("--algos", type=_choices(ALGOS), help=f"{','.join(ALGOS)}; default: the config's algo.kind")
    cmd.add_argument(
        "--off-policy",
        type=_degrees,
        help="degrees k: optimizer steps per rollout batch (algo.num_minibatches); default: the config's",
    )
    cmd.add_argument(
        "--vary",
        type=parse_vary,
        action="append",
        default=[],
        metavar="algo.KEY=V1,V2",
        help="one more axis: an algo setting and its values (YAML, e.g. "
        "algo.rollout_correction.rollout_is=token,sequence,null); repeat for every combination",
    )
    cmd.add_argument("--steps", type=_positive, help="steps per run; default: the config's trainer.steps")
    cmd.add_argument(
        "--seeds",
        type=_positive,
        default=1,
        help="seeds per combination (trainer.seed 0..K-1); a verdict needs 2 at least",
    )
    cmd.add_argument("--out", help="default: runs/compare-replay/<config name>")
    slurm = cmd.add_argument_group("Slurm (with --submit; the job options of `megatron-rlvr submit`)")
    slurm.add_argument("--submit", action="store_true", help="one Slurm job per run instead of running here")
    slurm.add_argument("--nodes", type=_positive, default=1, help="nodes per job")
    slurm.add_argument("--gpus-per-node", type=int, help="GPUs per node (0: CPU nodes); needed with --submit")
    add_job_options(slurm)
    add_submit_flags(slurm)  # --gpu-memory, --link-gbps, --prompt-tokens, --no-memory-check


def _setup_lines(args, cfg, steps: int, out: Path) -> list[str]:
    overrides = f" with {' '.join(args.overrides)}" if args.overrides else ""
    engine_dtype = getattr(cfg.rollout.engine, "dtype", "?")
    varied = " and ".join(f"`{axis.key}` ({', '.join(axis.values)})" for axis in args.vary)
    return [
        f"Config `{args.config}`{overrides}: {steps} steps per run, "
        + (f"seeds 0..{args.seeds - 1} per combination" if args.seeds > 1 else "seed 0")
        + f" (trainer.seed), learner in {cfg.trainer.dtype}, engine in {engine_dtype}.",
        "Every run starts from the same initial weights with the same data order and rollout seeds; runs "
        "differ only in the routing-replay mode (none, r2: the learner's own routing from the old-logprob "
        "pass, r3: the engine's), the algorithm and the off-policy degree k (algo.num_minibatches: k "
        "optimizer steps per rollout batch, so later mini-batches train off-policy)"
        + (f", and in {varied} (--vary: every combination)." if varied else "."),
        f"Runs and their metrics: `{out / 'runs'}`.",
    ]


def main(args: argparse.Namespace, stop: StopSignals | None = None) -> int:
    """Ctrl-C or SIGTERM (recorded in `stop`) stops the current run cleanly and keeps the
    finished ones; a second signal is passed on to the run, which then ends at once."""
    stop = stop or StopSignals()
    out = Path(args.out or Path("runs/compare-replay") / Path(args.config).stem).absolute()
    if args.submit and args.gpus_per_node is None:
        raise CompareError("compare-replay --submit needs --gpus-per-node (0 for CPU-only nodes)")
    with run_lock(out):
        return _compare(args, stop, out)


def _compare(args: argparse.Namespace, stop: StopSignals, out: Path) -> int:
    plans: list[RunPlan] = []
    try:
        cfg = load_config(args.config, args.overrides)
        steps = args.steps or cfg.trainer.steps
        algos = args.algos or [cfg.algo.kind]
        degrees = args.off_policy or [cfg.algo.num_minibatches]
        plans = plan_runs(
            args.config,
            args.overrides,
            cfg,
            modes=args.modes,
            algos=algos,
            off_policy=degrees,
            varied=args.vary,
            steps=steps,
            seeds=args.seeds,
            out=out,
        )
        if args.submit:
            from megatron_rlvr.compare.runner import submit

            waiting = submit(plans, args)
            if waiting:
                print(
                    f"compare-replay: {len(waiting)} of {len(plans)} runs queued or running; run the same "
                    "command again to collect them (the report is written once all have finished)"
                )
                return 0
        else:
            from megatron_rlvr.compare.runner import run_local

            run_local(plans, stop)
        from megatron_rlvr.compare.report import write_report

        setup = _setup_lines(args, cfg, steps, out) + [
            f"Run `{p.name}` ended at step {p.steps_logged()} of {steps}: {p.ended_early()}"
            for p in plans
            if p.ended_early()
        ]
        verdicts = write_report(out, [p.result() for p in plans], setup, steps, args.seeds)
    except StopRequested as err:
        finished = sum(p.finished() for p in plans)
        print(
            f"megatron-rlvr compare-replay: {err}; {finished} of {len(plans)} runs finished and "
            "kept; run the same command again to resume",
            file=sys.stderr,
        )
        return 130
    for text in verdicts:
        print(text.replace("**", ""))
    print(f"report: {out / 'report.md'} (and report.html), table: {out / 'table.csv'}, plots: {out / 'plots'}")
    return 0
