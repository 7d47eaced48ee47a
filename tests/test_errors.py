"""Every error meant for the user is a UserError, and every UserError reaches the command
line as one line and exit code 2, from any command, raised here or inside a Ray actor."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import megatron_rlvr
from megatron_rlvr import cli
from megatron_rlvr.errors import UserError

REPO = Path(__file__).resolve().parents[1]

# Exceptions that never reach the user, and what catches them.
INTERNAL = {
    "BadRow": "data.files turns it into a DataError naming file:line, or counts the row as skipped",
    "_NoOrder": "math.compare: a comparison without an order; the verifier's verdict says why",
    "Undecided": "math.evaluate: numeric evaluation could not decide; sympy is asked next",
    "NotAValue": "rewards.runner: a solution's return that is not plain data scores 0 with reason not_a_value",
    "ConstraintError": "data.files turns a record's unreadable ifeval instructions into a DataError naming file:line",
    "ValueFailed": "rewards.runner/code: a value whose call raised in the sandbox decides the verdict where it is read",
    "AnswerError": "math.text: no final answer found; the verdict's reason counts it",
    "EngineRequestError": "the rollout manager retries or moves the group, counted in metrics",
    "EngineUnavailable": "the rollout manager restarts the engine or moves the group",
    "EngineError": "the CPU engine server's HTTP 400 answer to a bad request",
    "ToolInfraError": "the rollout manager runs the episode again (agent.max_episode_attempts), then fails its group, counted",
    "JudgeUnavailable": "the judge verifier returns the group unscored; the buffer drops it and counts it",
    "GroupFailed": "the rollout manager files the group as failed (its error set), counted in rollout metrics",
    "ToolsFailed": "the rollout manager files the group as failed after its episode's tries, counted as tool_failed",
    "EnginesNeedWeights": "run.next_batch pushes the current weights to restarted engines",
    "NothingToLearn": "the trainer ends the run with a checkpoint and exit 0",
    "StopRequested": "each command ends with exit 130 and says what was kept",
}


def package_exceptions() -> dict[str, type]:
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(megatron_rlvr.__path__, "megatron_rlvr."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                    found[f"{module.__name__}.{name}"] = obj
    return found


def user_errors() -> list[type]:
    return [cls for cls in package_exceptions().values() if issubclass(cls, UserError) and cls is not UserError]


def test_every_exception_is_a_user_error_or_known_to_be_caught_inside():
    for path, cls in package_exceptions().items():
        if not issubclass(cls, UserError):
            assert cls.__name__ in INTERNAL, f"{path} is neither a UserError nor caught inside (INTERNAL)"
    assert len(user_errors()) >= 15


def make(cls: type) -> UserError:
    if "problems" in inspect.signature(cls.__init__).parameters:  # ConfigError: one line per problem
        return cls(["rollout.num_engines: must be at least 1"])
    return cls(f"{cls.__name__} says what is wrong: data/train.jsonl:3")


@pytest.mark.parametrize("command", ["train", "sft", "convert", "submit", "compare-replay"])
def test_every_user_error_is_one_line_and_exit_2_from_every_command(command, monkeypatch, capsys):
    from ray.exceptions import RayTaskError

    for cls in user_errors():
        for wrapped in (False, True):
            err = make(cls)
            if wrapped:  # raised in a Ray actor: the caller sees RayTaskError(cls) with a traceback
                err = RayTaskError(
                    "LearnerRank.setup", "Traceback (most recent call last):\n  ...", err
                ).as_instanceof_cause()

            def fail(args, err=err):
                raise err

            monkeypatch.setattr(cli, "_run", fail)
            args = {
                "train": ["train", "c.yaml"],
                "sft": ["sft", "c.yaml"],
                "convert": ["convert", "hf-to-mcore", "--hf", "x", "--out", "y"],
                "submit": ["submit", "c.yaml", "--nodes", "1", "--gpus-per-node", "0"],
                "compare-replay": ["compare-replay", "c.yaml"],
            }[command]
            assert cli.main(args) == 2, cls
            lines = capsys.readouterr().err.strip().splitlines()
            assert "Traceback" not in "\n".join(lines), cls
            if cls.__name__ == "ConfigError":
                assert lines == ["config error: rollout.num_engines: must be at least 1"]
            else:
                assert lines == [f"megatron-rlvr {command}: {cls.__name__} says what is wrong: data/train.jsonl:3"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", "configs/tiny-moe-cpu.yaml", "rollout.num_engines=0"], "config error: rollout.num_engines"),
        (
            ["train", "configs/tiny-moe-cpu.yaml", "data.type=file", "data.path=/nonexistent/train.jsonl"],
            "megatron-rlvr train: data.path",
        ),
        (
            ["convert", "hf-to-mcore", "--hf", "/nonexistent/model", "--out", "/tmp/never-written"],
            "megatron-rlvr convert: --hf /nonexistent/model: no config.json there",
        ),
        (
            [
                "submit",
                "configs/tiny-moe-cpu.yaml",
                "--nodes",
                "1",
                "--gpus-per-node",
                "3",
                "parallel.device=cuda",
                "parallel.tp=2",
            ],
            "megatron-rlvr submit:",
        ),
    ],
)
def test_real_commands_with_bad_input_say_one_line(argv, says, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", *argv, f"trainer.output_dir={tmp_path}"]
        if argv[0] in ("train", "submit")
        else [sys.executable, "-m", "megatron_rlvr.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = [
        line
        for line in done.stderr.splitlines()
        if line.strip() and "Warning" not in line and not line.startswith("  warnings.warn")
    ]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(says), done.stderr
