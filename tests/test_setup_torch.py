"""Where scripts/setup.sh and scripts/setup_sglang_cpu.sh take torch's CPU build from
(--print-torch-install: the decision only, nothing installed): PyTorch's CPU index when it
answers, pip's own configuration with a line saying so when it does not, or what
TORCH_INDEX_URL / TORCH_SPEC say. PyPI alone would give the CUDA build."""

import functools
import http.server
import socket
import subprocess
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["scripts/setup.sh", "scripts/setup_sglang_cpu.sh"]


def decide(script: str, **env: str) -> tuple[list[str], str]:
    done = subprocess.run(
        ["bash", script, "--print-torch-install"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), done.stderr


@pytest.fixture
def index(tmp_path):
    """An index that answers, on loopback."""
    (tmp_path / "whl" / "cpu").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_cpu_index_is_used_when_it_answers(script, index):
    args, said = decide(script, TORCH_INDEX_URL=index)
    assert args == ["--index-url", index, "torch==2.13.0"]
    assert f"torch==2.13.0, CPU build, from {index}" in said


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unreachable_index_falls_back_to_pips_own_and_says_so(script):
    url = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    args, said = decide(script, TORCH_INDEX_URL=url)
    assert args == ["torch==2.13.0"]
    assert f"{url} is not reachable" in said and "from pip's configured index instead" in said


def test_an_empty_index_means_pips_own_and_the_spec_can_change():
    args, said = decide(SCRIPTS[0], TORCH_INDEX_URL="", TORCH_SPEC="torch==2.13.0+cpu")
    assert args == ["torch==2.13.0+cpu"] and "TORCH_INDEX_URL is empty" in said


def test_by_default_pytorchs_cpu_index_is_asked():
    args, said = decide(SCRIPTS[0])  # this machine cannot reach it: the fallback, within the check's limit
    assert args[-1] == "torch==2.13.0" and "https://download.pytorch.org/whl/cpu" in said
