#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with every dependency pinned.
#
#   bash scripts/setup.sh                CPU: torch 2.13.0's CPU build first (PyTorch's CPU index when it
#                                        answers, else pip's own index, said in a line; TORCH_INDEX_URL,
#                                        TORCH_SPEC override: scripts/torch_cpu.sh), held by constraints.txt;
#                                        otherwise pip resolves torch from PyPI and pulls gigabytes of
#                                        CUDA packages.
#   bash scripts/setup.sh --sglang-cpu   the same, and at the same time scripts/setup_sglang_cpu.sh (the
#                                        real SGLang on CPU that the tests use, in .venv-sglang): the two
#                                        venvs install side by side, one pip each (the README's test command).
#   bash scripts/setup.sh --print-torch-install   where the CPU torch would come from, and the pip
#                                        arguments; installs nothing.
#   bash scripts/setup.sh --gpu          GPU nodes (Linux x86-64, CUDA 13 driver): the learner and SGLang
#                                        in ONE venv, every package pinned by constraints-gpu.txt:
#                                        torch 2.14.1 (PyPI's CUDA 13.0 build), SGLang 0.5.23,
#                                        transformer-engine 2.20.2, Megatron-Core 0.16.1. One torch
#                                        build for both ends of the NCCL weight-update group.
#   bash scripts/setup.sh --gpu --check  proves constraints-gpu.txt resolves (a resolver run over package
#                                        metadata in a throwaway venv, scripts/gpu_pins.py); installs
#                                        nothing, downloads no CUDA wheel. Exit 3: index unreachable.
#
# Idempotent: a second run with unchanged pins only checks a stamp and returns at once.
# pip byte-compiles what it installs (~1.5 CPU-minutes per venv). Keep it: where
# PYTHONDONTWRITEBYTECODE is set (this project's machines and CI) Python never caches bytecode at
# import, so without it every process would compile torch, Megatron and SGLang from source.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
gpu=0 check=0 sglang_cpu=0
source scripts/torch_cpu.sh
for arg in "$@"; do
    case "$arg" in
        --gpu) gpu=1 ;;
        --check) check=1 ;;
        --sglang-cpu) sglang_cpu=1 ;;
        --print-torch-install) torch_install_args "$PYTHON"; exit 0 ;;
        *) echo "setup.sh: unknown argument $arg (use --gpu, --gpu --check, --sglang-cpu, --print-torch-install)" >&2; exit 2 ;;
    esac
done
if [ "$check" = 1 ]; then
    [ "$gpu" = 1 ] || { echo "setup.sh: --check checks the GPU pins: use --gpu --check" >&2; exit 2; }
    exec "$PYTHON" scripts/gpu_pins.py check
fi
if [ "$sglang_cpu" = 1 ]; then
    [ "$gpu" = 0 ] || { echo "setup.sh: --sglang-cpu is for CPU machines (--gpu puts SGLang in .venv)" >&2; exit 2; }
    bash scripts/setup_sglang_cpu.sh &
    sglang_pid=$!
    # should this half fail, stop the other (the script and its pip)
    trap 'pkill -P "$sglang_pid" 2>/dev/null; kill "$sglang_pid" 2>/dev/null || true' EXIT
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
stamp=.venv/.megatron-rlvr-installed
if [ "$gpu" = 1 ]; then
    want="gpu $(cat pyproject.toml constraints-gpu.txt | sha256sum | cut -d' ' -f1)"
else
    want="cpu $(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
fi
install_venv() {
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    held="$(cut -d' ' -f1 "$stamp" 2>/dev/null || true)"
    if { [ "$held" = cpu ] || [ "$held" = gpu ]; } && [ "$held" != "${want%% *}" ]; then
        echo "setup.sh: .venv holds the $held environment; reinstalling it as ${want%% *}" >&2
    fi
    if [ "$gpu" = 1 ]; then
        # torch first, then everything but transformer-engine's torch extension, which builds against
        # the torch installed here (--no-build-isolation, as transformer-engine's docs ask).
        "${PIP[@]}" -c constraints-gpu.txt torch setuptools ninja
        "${PIP[@]}" -c constraints-gpu.txt -e ".[dev]" sglang transformer-engine-cu13
        "${PIP[@]}" -c constraints-gpu.txt --no-build-isolation -e ".[gpu,dev]"
    else
        mapfile -t torch_args < <(torch_install_args .venv/bin/python)
        "${PIP[@]}" "${torch_args[@]}"
        "${PIP[@]}" -c constraints.txt -e ".[dev]"
    fi
    echo "$want" > "$stamp"
}

install_venv
if [ "$sglang_cpu" = 1 ]; then
    trap - EXIT
    wait "$sglang_pid" || { echo "setup.sh: .venv-sglang was not made (scripts/setup_sglang_cpu.sh, its output above)" >&2; exit 1; }
fi
