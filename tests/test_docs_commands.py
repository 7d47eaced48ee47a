"""The docs cannot lie about commands: every `megatron-rlvr …`, `python tools/…` and
`python benchmarks/…` command line shown in README.md and docs/ is checked against the code.

- A concrete `megatron-rlvr` command is parsed by the CLI's own parser (cli.parse_args, in
  process); its config and overrides are loaded and resolved when they name nothing outside
  the repository (an HF checkpoint at /models/… is a reader's own), and a `--dry-run` command
  is run, in process, exactly as `megatron-rlvr` would run it.
- A synopsis (`megatron-rlvr submit CONFIG [key=value ...] --nodes N`) has placeholders, so
  only its options are checked: each must be one the sub-command's parser declares.
- A script (`tools/…`, `benchmarks/…`) must exist, every option shown must be declared by one of
  its `add_argument` calls (read from its source), and `--help` must run (every script in one
  child process, so heavy imports are paid once). The tools that are the CLI under another name are parsed as the CLI.
- Every `configs/*.yaml` named anywhere in the docs exists.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STARTS_FROM_AN_EXPORT

from megatron_rlvr import cli
from megatron_rlvr.config import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# the tools that are `megatron-rlvr <command>` under another name
CLI_ALIASES = {
    "tools/convert_checkpoint.py": ["convert"],
    "tools/submit_slurm.py": ["submit"],
    "tools/compare_routing_replay.py": ["compare-replay"],
}
COMMAND = re.compile(r"^(?:\.venv/bin/)?(megatron-rlvr|python)\s")
SCRIPT = re.compile(r"^(tools|benchmarks)/[\w-]+\.py$")
CONFIG_PATH = re.compile(r"(?<![\w-])configs/[\w./-]+\.yaml")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # CONFIG, DIR, N, HF_DIR, GOLD


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def command_lines(text: str) -> list[str]:
    """The command lines of a page: lines of its code blocks (fenced, or indented four spaces)
    with `\\` continuations and deeper-indented wrapped lines joined, split at `&&`, trailing `# comments` dropped, kept when they
    start with megatron-rlvr or python (optionally from .venv/bin/)."""
    lines, fenced, joined = text.splitlines(), False, []
    pending = ""
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            pending = ""
            continue
        if not fenced and line.startswith("        ") and joined and COMMAND.match(joined[-1]):
            joined[-1] += " " + line.strip()  # a synopsis wrapped onto a deeper-indented line
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        joined.append(line)
    found = []
    for line in joined:
        for segment in line.split("&&"):
            segment = re.sub(r"\s+#\s.*$", "", segment).strip()
            if COMMAND.match(segment):
                found.append(segment)
    return found


def is_synopsis(words: list[str]) -> bool:
    return any(re.search(r"[\[\]|…]|\.\.\.", w) or PLACEHOLDER.match(w.split("=")[-1]) or w in ("-",) for w in words)


@functools.cache
def cli_options() -> dict[tuple[str, ...], frozenset[str]]:
    """The options each (sub-)command of `megatron-rlvr` declares, keyed by its command path."""
    found: dict[tuple[str, ...], frozenset[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        found[path] = frozenset(o for a in parser._actions for o in a.option_strings)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))

    walk(cli._parser(), ())
    return found


def _options(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def check_cli(argv: list[str]) -> list[str]:
    """What is wrong with `megatron-rlvr <argv>` as the docs show it ([] when nothing)."""
    if is_synopsis(argv):
        path: tuple[str, ...] = ()
        for word in argv:
            if (*path, word) in cli_options():
                path = (*path, word)
        known = cli_options()[path] | cli_options()[()]
        return [
            f"{option}: not an option of `megatron-rlvr {' '.join(path)}`"
            for option in _options(argv)
            if option not in known
        ]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli.parse_args(argv)
    except SystemExit:
        return [err.getvalue().strip().splitlines()[-1]]
    config = getattr(args, "config", None)
    if config is None:
        return []
    if not (REPO / config).is_file():
        return [f"{config}: no such config"]
    outside = [w for w in argv if re.search(r"(^|=)/", w) or "{" in w]
    if outside:  # paths on the reader's machine: the parse above is what can be checked here
        return []
    if Path(config).name in STARTS_FROM_AN_EXPORT:  # its model is what an earlier command (sft) writes
        return []
    return _resolve(tuple(argv), config, tuple(args.overrides), getattr(args, "dry_run", False))


@functools.cache
def _resolve(argv: tuple[str, ...], config: str, overrides: tuple[str, ...], dry_run: bool) -> list[str]:
    cwd = os.getcwd()
    os.chdir(REPO)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            try:
                load_config(config, list(overrides))
            except Exception as error:
                return [f"{config} {' '.join(overrides)}: {error}"]
            if dry_run:
                with contextlib.redirect_stdout(io.StringIO()):
                    code = cli.main(list(argv))
                if code != 0:
                    return [f"--dry-run exited {code}: {err.getvalue().strip()}"]
    finally:
        os.chdir(cwd)
    return []


@functools.cache
def declared_options(script: str) -> frozenset[str]:
    """The option strings of every add_argument call in the script and the repository
    modules it imports from its own folder (benchmarks/_common.py)."""
    sources = [REPO / script]
    tree = ast.parse(sources[0].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("megatron_rlvr"):
            sibling = sources[0].parent / f"{node.module.split('.')[-1]}.py"
            if sibling.is_file():
                sources.append(sibling)
    options = set()
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                options |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return frozenset(options | {"-h", "--help"})


def check_script(script: str, args: list[str]) -> list[str]:
    if script in CLI_ALIASES:
        return check_cli([*CLI_ALIASES[script], *args])
    if not (REPO / script).is_file():
        return [f"{script}: no such script"]
    return [
        f"{option}: not an option of {script}" for option in _options(args) if option not in declared_options(script)
    ]


def problems_in(text: str) -> list[str]:
    """Every problem with the commands and config paths of one page's text."""
    problems = []
    for line in command_lines(text):
        words = shlex.split(line)
        program = words[0].rsplit("/", 1)[-1]
        if program == "megatron-rlvr":
            found = check_cli(words[1:])
        elif len(words) > 1 and SCRIPT.match(words[1]):
            found = check_script(words[1], words[2:])
        else:
            continue  # python -m ..., python -c ...: not a command of this project's docs
        problems += [f"`{line}`: {p}" for p in found]
    for path in sorted(set(CONFIG_PATH.findall(text))):
        if not (REPO / path).is_file():
            problems.append(f"{path}: no such config")
    return problems


def scripts_shown() -> list[str]:
    found = set()
    for page in DOCS:
        for line in command_lines(page.read_text()):
            words = shlex.split(line)
            if words[0].endswith("python") and len(words) > 1 and SCRIPT.match(words[1]):
                found.add(words[1])
    return sorted(found - set(CLI_ALIASES))


@pytest.mark.parametrize("page", DOCS, ids=[_rel(p) for p in DOCS])
def test_every_command_and_config_a_page_shows_is_real(page):
    assert problems_in(page.read_text()) == []


def test_the_docs_show_the_commands_they_should():
    lines = [line for page in DOCS for line in command_lines(page.read_text())]
    for expected in (
        "megatron-rlvr train",
        "megatron-rlvr submit",
        "megatron-rlvr convert",
        "megatron-rlvr compare-replay",
    ):
        assert any(expected in line for line in lines), expected
    assert len(scripts_shown()) >= 8


# Runs each script's `--help` as `python SCRIPT --help` would, in ONE child process, so the
# heavy imports (Megatron, for the learner benchmarks) are paid once; prints one JSON line.
HELP_ALL = """
import contextlib, io, json, os, runpy, sys
report = {}
for script in sys.argv[1:]:
    out, sys.argv = io.StringIO(), [script, "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts it first
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    except BaseException as error:
        code = f"{type(error).__name__}: {error}"
    sys.path.pop(0)
    report[script] = [code, "usage:" in out.getvalue()]
print(json.dumps(report))
"""


def test_every_script_the_docs_show_answers_help():
    scripts = scripts_shown()
    run = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *scripts], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert {s: r for s, r in report.items() if r != [0, True]} == {}
    assert sorted(report) == scripts


def test_a_broken_example_is_caught():
    broken = """
Some prose, then commands as a page would show them:

    .venv/bin/megatron-rlvr train configs/tiny-moe-cpu.yaml --no-such-flag
    .venv/bin/megatron-rlvr train configs/tiny-moe-cpu.yaml algo.kind=ppo --dry-run
    .venv/bin/megatron-rlvr train configs/renamed-away.yaml
    .venv/bin/megatron-rlvr submit CONFIG [key=value ...] --nodez N --gpus-per-node G
    .venv/bin/python benchmarks/greso.py --seedz 2 3
    .venv/bin/python tools/no_such_tool.py
    bash scripts/setup.sh && .venv/bin/megatron-rlvr convert hf-to-mcore --hf a --out b --tp two

and a config named in passing: `configs/gone.yaml`.
"""
    problems = problems_in(broken)
    expected = [
        "--no-such-flag",
        "algo.kind",
        "configs/renamed-away.yaml: no such config",
        "--nodez: not an option",
        "--seedz: not an option of benchmarks/greso.py",
        "tools/no_such_tool.py: no such script",
        "--tp: invalid int value",
        "configs/gone.yaml: no such config",
    ]
    for needle in expected:
        assert any(needle in p for p in problems), (needle, problems)
    assert len(problems) == len(expected) + 1  # configs/renamed-away.yaml also named in passing


def test_a_correct_example_passes():
    good = """
    .venv/bin/megatron-rlvr train configs/tiny-moe-cpu.yaml algo.kind=gspo parallel.ep=2 --dry-run
    .venv/bin/megatron-rlvr convert mcore-to-hf --ckpt RUN/checkpoint --out DIR [--hf-config DIR]
    .venv/bin/python benchmarks/greso.py --runs polarising --seeds 2 3
"""
    assert problems_in(good) == []
