"""The linters pass: ruff's checks and mypy as configured in pyproject.toml ([tool.ruff],
[tool.mypy]), each run as a user would run it, with its report shown when it fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    done = run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, f"ruff check found problems:\n{done.stdout}{done.stderr}"


def test_ruff_format_is_clean():
    done = run("ruff", "format", "--check", "--no-cache", ".")
    assert done.returncode == 0, f"ruff format would change:\n{done.stdout}{done.stderr}"


def test_mypy_is_clean():
    done = run("mypy")  # files and settings from [tool.mypy]
    assert done.returncode == 0, f"mypy found problems:\n{done.stdout}{done.stderr}"
