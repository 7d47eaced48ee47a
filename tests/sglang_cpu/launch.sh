#!/usr/bin/env bash
# Starts a real SGLang 0.5.23 HTTP server on CPU by hand, bound to 127.0.0.1, from .venv-sglang
# (scripts/setup_sglang_cpu.sh builds it), with exactly the command and environment a run's
# launcher uses for rollout.engine {type: sglang, device: cpu} (megatron_rlvr/rollout/launcher.py
# says why each CPU flag and variable is there):
#
#   tests/sglang_cpu/launch.sh MODEL_DIR PORT [more sglang flags, e.g. --enable-return-routed-experts --tp-size 2]
#
# It execs the server, so this script's pid is the server's: stop it with `kill PID`. Ready when
# GET /health returns 200 (about 25 s for the tiny model on 2 cores).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 MODEL_DIR PORT [more sglang flags]" >&2
    exit 2
fi
root="$(cd "$(dirname "$0")/../.." && pwd)"
if [ ! -x "$root/.venv-sglang/bin/python" ]; then
    echo "$root/.venv-sglang/bin/python is missing: run scripts/setup_sglang_cpu.sh first" >&2
    exit 2
fi
exec "$root/.venv/bin/python" - "$root/.venv-sglang/bin/python" "$@" <<'PY'
import os
import sys

from megatron_rlvr.config import SglangEngine
from megatron_rlvr.rollout.launcher import sglang_command, sglang_env

python, model_dir, port, *flags = sys.argv[1:]
engine = SglangEngine(device="cpu", python=python, dtype="float32", extra_args=flags)
command = sglang_command(model_dir, engine, "127.0.0.1", int(port), routed_experts=False)
os.execvpe(command[0], command, {**os.environ, "OMP_NUM_THREADS": "1", **sglang_env(engine)})
PY
