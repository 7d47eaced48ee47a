"""Proves that the GPU environment's pins resolve together, without installing them.

    python scripts/gpu_pins.py check [--constraints FILE]   # bash scripts/setup.sh --gpu --check
    python scripts/gpu_pins.py lock                          # rewrites constraints-gpu.txt's closure

`check` resolves the project with its gpu and dev extras under constraints-gpu.txt in a
throwaway venv of this interpreter (CPython 3.11 on Linux x86-64, as on the GPU nodes), with
uv's resolver (`uv pip install --dry-run`; uv pinned below, installed into the throwaway venv).
It fails, with the resolver's explanation, if any two pins disagree (SGLang 0.5.23's,
transformer-engine's, Megatron-Core's, the project's). No wheel is downloaded: PyPI serves no
separate metadata (PEP 658) for most of these wheels, so the resolver reads each wheel's
METADATA with HTTP range requests, a few kB per wheel, in parallel: seconds, where pip's
resolver (`pip install --dry-run --use-feature=fast-deps`, serial) took minutes for the same
answer. One package is an sdist whose metadata would need a build with a CUDA torch:
transformer_engine_torch. The check stands in a wheel holding exactly the PKG-INFO that its
sdist on PyPI ships (its requirements as built against a CUDA 13 torch, the torch pinned here),
so the resolver uses the published metadata.

Exit codes: 0 consistent, 1 conflict (the resolver's message is printed), 3 the index cannot be
reached.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints-gpu.txt"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
SDIST_ONLY = "transformer_engine_torch"  # needs a CUDA torch to build its metadata
CLOSURE_MARK = "# ---- resolved closure"
UV = "uv==0.13.9"


def pinned(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name)] = version.strip()
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def fetch(url: str, accept: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def standin_wheel(version: str, out: Path) -> Path:
    """A wheel of transformer_engine_torch whose METADATA is its PyPI sdist's PKG-INFO."""
    files = json.loads(fetch(f"{INDEX}/{SDIST_ONLY.replace('_', '-')}/", "application/vnd.pypi.simple.v1+json"))[
        "files"
    ]
    url = next(f["url"] for f in files if f["filename"] == f"{SDIST_ONLY}-{version}.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(fetch(url)), mode="r:gz") as sdist:
        pkg_info = sdist.extractfile(f"{SDIST_ONLY}-{version}/PKG-INFO").read()
    dist_info = f"{SDIST_ONLY}-{version}.dist-info"
    wheel_meta = b"Wheel-Version: 1.0\nGenerator: megatron-rlvr gpu_pins\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    entries = {f"{dist_info}/METADATA": pkg_info, f"{dist_info}/WHEEL": wheel_meta}
    record = (
        "".join(
            f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}\n"
            for name, data in entries.items()
        )
        + f"{dist_info}/RECORD,,\n"
    )
    path = out / f"{SDIST_ONLY}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in {**entries, f"{dist_info}/RECORD": record.encode()}.items():
            whl.writestr(name, data)
    return path


def resolve(constraints: Path, work: Path) -> tuple[int, str, dict[str, str]]:
    """(exit code, the resolver's output, {name: version} it would install)."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", UV], check=True
    )
    links = work / "standins"
    links.mkdir()
    standin_wheel(pinned(constraints).get(normalize(SDIST_ONLY), "2.20.2"), links)
    done = subprocess.run(
        [
            str(venv / "bin" / "uv"),
            "pip",
            "install",
            "--dry-run",
            "--python",
            str(venv / "bin" / "python"),
            "--index-url",
            INDEX,
            "--find-links",
            str(links),
            "-c",
            str(constraints),
            f"{REPO}[gpu,dev]",
        ],
        capture_output=True,
        text=True,
    )
    out = done.stdout + done.stderr
    chosen = dict(re.findall(r"^ \+ ([A-Za-z0-9_.\-]+)==(\S+)$", out, re.M))
    return done.returncode, out, {normalize(n): v for n, v in chosen.items()}


def reachable() -> bool:
    try:
        fetch(f"{INDEX}/pip/", "application/vnd.pypi.simple.v1+json")
    except (urllib.error.URLError, OSError):
        return False
    return True


def check(constraints: Path) -> int:
    if not reachable():
        print(f"gpu pins: cannot reach the package index {INDEX}: nothing checked", file=sys.stderr)
        return 3
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-pins-") as tmp:
        code, out, chosen = resolve(constraints, Path(tmp))
    if code:
        print(out.strip()[-4000:], file=sys.stderr)
        print(f"gpu pins: CONFLICT in {constraints.name} (the resolver's explanation above)", file=sys.stderr)
        return 1
    pins = pinned(constraints)
    unpinned = sorted(set(chosen) - set(pins))
    differ = sorted(n for n in set(pins) & set(chosen) if pins[n] != chosen[n])
    if differ:  # cannot happen under -c, but a report that disagrees with the pins must not pass
        print(f"gpu pins: resolved versions differ from the pins: {differ}", file=sys.stderr)
        return 1
    key = (
        "torch",
        "transformers",
        "sglang",
        "transformer-engine",
        "transformer-engine-torch",
        "transformer-engine-cu13",
        "megatron-core",
        "mbridge",
        "nvidia-nccl-cu13",
        "flashinfer-python",
        "numpy",
    )
    print(
        f"gpu pins: consistent: {len(chosen)} packages resolve together "
        f"in {time.monotonic() - started:.0f} s (metadata only: nothing installed, no wheel downloaded)"
    )
    print("  " + ", ".join(f"{k}=={chosen[k]}" for k in key if k in chosen))
    if unpinned:
        print(f"  not pinned in {constraints.name} (resolved freely): {', '.join(unpinned)}")
    return 0


def lock() -> int:
    """Resolves the section above CLOSURE_MARK (the pins chosen on purpose) and writes every
    resolved package below it, so an install is the same everywhere."""
    text = CONSTRAINTS.read_text()
    head = text.split(CLOSURE_MARK)[0]
    with tempfile.TemporaryDirectory(prefix="gpu-pins-") as tmp:
        (Path(tmp) / "chosen.txt").write_text(head)
        code, out, resolved = resolve(Path(tmp) / "chosen.txt", Path(tmp))
        chosen = pinned(Path(tmp) / "chosen.txt")
    if code:
        print(out[-4000:], file=sys.stderr)
        return 1
    closure = [f"{n}=={v}" for n, v in sorted(resolved.items()) if n not in chosen]
    CONSTRAINTS.write_text(
        head + CLOSURE_MARK + " (python scripts/gpu_pins.py lock) ----\n" + "\n".join(closure) + "\n"
    )
    print(f"wrote {len(closure)} resolved pins below {len(chosen)} chosen ones into {CONSTRAINTS.name}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "lock"])
    parser.add_argument("--constraints", type=Path, default=CONSTRAINTS)
    args = parser.parse_args()
    return check(args.constraints) if args.command == "check" else lock()


if __name__ == "__main__":
    sys.exit(main())
