"""`megatron-rlvr plan`: the memory plan of a config on N × G GPUs, and the check `submit` runs.

    megatron-rlvr plan CONFIG [key=value ...] --nodes N --gpus-per-node G [--gpu-memory GB]
        [--link-gbps X] [--prompt-tokens T]

Prints, for the most loaded learner rank and one engine GPU, bytes by term with the inputs of
each formula, and the weight sync's size and time; exits 2 with one line when a GPU would be
over its memory. Reads only config.json: no torch, seconds on a login node.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable

from megatron_rlvr.config import ResolvedConfig, SglangEngine, load_config
from megatron_rlvr.plan.build import DEFAULT_PROMPT_TOKENS, plan_run
from megatron_rlvr.plan.report import MemoryPlanError, check, lines


def add_memory_flags(cmd: argparse.ArgumentParser) -> None:
    """The flags `plan` and `submit` share."""
    cmd.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB", help="memory of one GPU, GB (default 80)")
    cmd.add_argument(
        "--link-gbps",
        type=float,
        metavar="X",
        help="link rate of the weight sync, Gb/s (default: 100 for nccl, 10 for gloo)",
    )
    cmd.add_argument(
        "--prompt-tokens",
        type=int,
        default=DEFAULT_PROMPT_TOKENS,
        metavar="T",
        help=f"longest prompt, tokens (default {DEFAULT_PROMPT_TOKENS}); a row is this + rollout.max_new_tokens",
    )


def add_parser(sub) -> None:
    cmd = sub.add_parser("plan", help="memory per GPU of a config's layout, before you queue it")
    cmd.add_argument("config", help="YAML config, e.g. configs/qwen3-30b-a3b-grpo-r3.yaml")
    cmd.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    cmd.set_defaults(takes_overrides=True)
    cmd.add_argument("--nodes", type=int, required=True, help="nodes N")
    cmd.add_argument("--gpus-per-node", type=int, required=True, help="GPUs G per node")
    add_memory_flags(cmd)


def memory_report(cfg: ResolvedConfig, args: argparse.Namespace, out=None) -> list[str]:
    """Prints the plan; raises MemoryPlanError when it does not fit; returns the warnings."""
    out = out or sys.stdout
    plan = plan_run(cfg, args.gpu_memory, args.link_gbps, args.prompt_tokens)
    for line in lines(plan):
        print(line, file=out)
    return check(plan)


def main(args: argparse.Namespace, gpu_lines: Callable[[ResolvedConfig], list[str]]) -> int:
    """`plan`: `gpu_lines` is the GPU-count check (launch/slurm.py's, which imports this module)."""
    cfg = load_config(args.config, args.overrides)
    for line in gpu_lines(cfg):
        print(line)
    for warning in memory_report(cfg, args):
        print(f"megatron-rlvr plan: warning: {warning}", file=sys.stderr)
    return 0


def add_submit_flags(cmd: argparse.ArgumentParser) -> None:
    add_memory_flags(cmd)
    cmd.add_argument(
        "--no-memory-check", action="store_true", help="submit even when the memory plan says a GPU is over"
    )


def submit_check(cfg: ResolvedConfig, args: argparse.Namespace) -> list[str]:
    """`submit`'s memory check: the plan's table (returned, for the script's header), a warning
    on stderr above 90%, a refusal (MemoryPlanError, one line) when a GPU is over its memory,
    unless --no-memory-check. Nothing for a run without GPUs."""
    engine = cfg.rollout.engine
    if cfg.parallel.device != "cuda" and not (isinstance(engine, SglangEngine) and engine.device == "cuda"):
        return []
    table = io.StringIO()
    try:
        warnings = memory_report(cfg, args, out=table)
    except MemoryPlanError as err:
        if not args.no_memory_check:
            raise
        warnings = [
            f"{str(err).removesuffix(' (--no-memory-check to submit anyway)')}; going ahead (--no-memory-check)"
        ]
    for warning in warnings:
        print(f"megatron-rlvr submit: warning: {warning}", file=sys.stderr)
    return table.getvalue().splitlines()
