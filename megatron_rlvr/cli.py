"""`megatron-rlvr` command line: train | sft | profile | convert | submit | plan | compare-replay."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from megatron_rlvr import profile
from megatron_rlvr.compare import command as compare_replay
from megatron_rlvr.config import load_config, to_yaml
from megatron_rlvr.convert import commands as convert
from megatron_rlvr.errors import UserError, original
from megatron_rlvr.launch import slurm
from megatron_rlvr.plan import command as plan_command
from megatron_rlvr.stopping import StopRequested, StopSignals

if TYPE_CHECKING:
    from megatron_rlvr.trainer import Outcome  # heavy: imported when a run starts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rlvr",
        description="RL with verifiable rewards for MoE LLMs (Megatron-Core + SGLang).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="run RL training from a YAML config")
    train.add_argument("config", help="YAML config, e.g. configs/tiny-moe-cpu.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides: algo.kind=gspo")
    train.set_defaults(takes_overrides=True)
    train.add_argument("--dry-run", action="store_true", help="print the resolved config as YAML and exit")
    sft = sub.add_parser("sft", help="supervised fine-tuning (a cold start for RL) from a YAML config")
    sft.add_argument("config", help="YAML config with an sft section, e.g. configs/long-answers-sft-cpu.yaml")
    sft.add_argument("overrides", nargs="*", help="dotted overrides: trainer.steps=50")
    sft.set_defaults(takes_overrides=True)
    profile.add_parser(sub)
    convert.add_parser(sub)
    slurm.add_submit_parser(sub)
    plan_command.add_parser(sub)
    compare_replay.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-rlvr")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _train(args: argparse.Namespace, stop: StopSignals) -> int:
    from megatron_rlvr import run_dir

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    found = run_dir.check_output_dir(cfg)
    if finished := run_dir.finished_message(cfg, found):
        print(f"megatron-rlvr train: {finished}", file=sys.stderr)
        return 0
    import logging

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("megatron_rlvr").setLevel(cfg.logging.level)  # ours; libraries stay quiet

    from megatron_rlvr.data.check import check_inputs

    check_inputs(cfg)  # data files, rows, verifier functions, sandbox: before Ray or a model starts

    from megatron_rlvr import trainer  # heavy: Megatron, transformers

    try:
        outcome = trainer.train(cfg, stop)
    except StopRequested as err:
        print(f"megatron-rlvr train: {err}; every component was stopped", file=sys.stderr)
        return 130
    return train_exit_code(outcome)


def _sft(args: argparse.Namespace, stop: StopSignals) -> int:
    import logging

    from megatron_rlvr.sft import command as sft

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("megatron_rlvr").setLevel(logging.INFO)
    try:
        metrics, model = sft.run_sft(args.config, args.overrides, stop)
    except StopRequested as err:
        print(f"megatron-rlvr sft: {err}", file=sys.stderr)
        return 130
    print(f"megatron-rlvr sft: done: {sft.summary(metrics)}; the model is in {model}", file=sys.stderr)
    return 0


def train_exit_code(outcome: Outcome) -> int:
    """The exit code of a run that ended without an error: 1 when a component failed to stop
    (the training itself finished; what failed is in the log above), else 0."""
    if outcome.message:
        print(f"megatron-rlvr train: {outcome.message}", file=sys.stderr)
    if outcome.teardown_failures:
        print(
            f"megatron-rlvr train: finished, but stopping failed for: {', '.join(outcome.teardown_failures)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "submit":
        return slurm.submit_command(args)
    if args.command == "plan":
        return plan_command.main(args, lambda cfg: slurm.plan(cfg, args.nodes, args.gpus_per_node).lines())
    # Long-running commands: Ctrl-C and SIGTERM are recorded, never raised where they land
    # (see stopping.py); each command looks at the request at its safe points.
    stop = StopSignals().install()
    if args.command == "train":
        return _train(args, stop)
    if args.command == "sft":
        return _sft(args, stop)
    if args.command == "profile":
        return profile.main(args, stop)
    if args.command == "compare-replay":
        return compare_replay.main(args, stop)
    return convert.main(args, stop)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `megatron-rlvr` reads it (a usage error exits 2); the docs' test
    parses every command the docs show through this."""
    parser = _parser()
    # Overrides may come before or after flags (`train C --dry-run a.b=1`): collect the
    # leftover key=value words ourselves, since argparse stops a positional list at a flag.
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "takes_overrides", False):
        unknown = [word for word in extra if word.startswith("-") or "=" not in word]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except UserError as err:  # the one place errors meant for the user are printed
        reported = original(err)
        return reported.report(args.command) if isinstance(reported, UserError) else err.report(args.command)


if __name__ == "__main__":
    sys.exit(main())
