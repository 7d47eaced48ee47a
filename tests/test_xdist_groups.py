"""The README's test command really groups what tests/conftest.py says it groups: pytest-xdist
reads the groups into the test ids in a hook of its own, and a group added after that hook is
silently ignored (it was, for a whole round: module fixtures were built on both workers and the
sandbox-counting modules were split)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_module_fixture_users_share_a_worker_group_and_the_rest_go_free():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-rA", "-p", "no:cacheprovider"]
        + ["tests/test_chat_prompts.py", "tests/test_advantages.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    passed = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("PASSED ")]
    prompts = [t for t in passed if t.startswith("tests/test_chat_prompts.py::")]
    advantages = [t for t in passed if t.startswith("tests/test_advantages.py::")]
    assert prompts and advantages
    fixture_users = [t for t in prompts if "[qwen]" in t or "[llama]" in t]  # its module fixture's params
    assert fixture_users and all(t.endswith("@test_chat_prompts") for t in fixture_users)
    assert not any("@" in t for t in advantages)  # no module fixture: any free worker
