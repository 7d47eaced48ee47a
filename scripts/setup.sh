#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with pinned dependencies.
# torch goes first, as the local CPU build, and stays pinned by constraints.txt;
# otherwise pip resolves torch from the index and pulls gigabytes of CUDA packages.
# Idempotent: a second run only checks and takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
stamp=.venv/.megatron-rlvr-installed
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -c constraints.txt -e ".[dev]"
echo "$want" > "$stamp"
