#!/usr/bin/env bash
# Starts a real SGLang 0.5.23 HTTP server on CPU, bound to 127.0.0.1, from the separate venv
# /work/main/.venv-sglang that scripts/setup_sglang_cpu.sh builds (run that first).
#
#   tests/sglang_cpu/launch.sh MODEL_DIR PORT [--enable-return-routed-experts] [more sglang flags]
#
# It `exec`s the server, so the pid of this script is the server's pid: stop it with
# `kill PID` (SGLang then stops its scheduler and detokenizer subprocesses itself).
# Ready when GET /health returns 200 (about 20 s for the tiny model on 2 cores).
#
# Why each setting:
#   SGLANG_USE_CPU_ENGINE=1        SGLang 0.5.23 selects its CPU platform (is_cpu()) only with
#                                  this variable; `--device cpu` alone is not enough.
#   --device cpu --attention-backend torch_native --sampling-backend pytorch --dtype float32
#                                  the plain-torch paths (no Triton/FlashInfer kernels).
#   --disable-cuda-graph           no graph capture (deprecated alias of
#                                  --cuda-graph-backend-{decode,prefill}=disabled in 0.5.23).
#   --sleep-on-idle                otherwise the idle scheduler busy-polls a whole core.
#   --skip-tokenizer-init          the tiny test model has no tokenizer files; requests carry
#                                  input_ids and responses carry output_ids (no "text").
#   --max-total-tokens 65536       without it the CPU KV pool is sized from free RAM: on a
#                                  24 GiB box it allocated 31M tokens (14.8 GB of KV plus a
#                                  0.46 GB routed-experts host buffer), 18.6 GB RSS and 17 s of
#                                  start-up. 65536 tokens is 32 MB of KV for the tiny model.
# Flags given after PORT are appended, so they can override these (argparse: last one wins).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 MODEL_DIR PORT [--enable-return-routed-experts] [more sglang flags]" >&2
    exit 2
fi
model_dir=$1
port=$2
shift 2
root="$(cd "$(dirname "$0")/../.." && pwd)"
py="$root/.venv-sglang/bin/python"
if [ ! -x "$py" ]; then
    echo "$py is missing: run scripts/setup_sglang_cpu.sh first" >&2
    exit 2
fi
export SGLANG_USE_CPU_ENGINE=1
exec "$py" -m sglang.launch_server \
    --model-path "$model_dir" --host 127.0.0.1 --port "$port" \
    --device cpu --attention-backend torch_native --sampling-backend pytorch \
    --disable-cuda-graph --dtype float32 --sleep-on-idle \
    --skip-tokenizer-init --max-total-tokens 65536 \
    "$@"
