#!/usr/bin/env bash
# The GPU path, proved in one command on a fresh one-GPU machine:
#   bash scripts/gpu_check.sh                 set up (setup.sh --gpu) and run every step, in order
#   bash scripts/gpu_check.sh --dry-run       list the steps and their commands
#   bash scripts/gpu_check.sh --smoke         on a CPU machine: the script's own machinery (CI runs it)
#   bash scripts/gpu_check.sh --skip-setup    reuse the GPU venv
# Writes runs/gpu-check/REPORT.md and REPORT.json (--out DIR to change); exits non-zero at the first
# failing step, naming it. The steps and why: scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
exec "$PYTHON" scripts/gpu_check.py "$@"
