#!/usr/bin/env bash
# Creates .venv-sglang: a venv of its own (never the project's .venv) holding a REAL
# SGLang 0.5.23 that serves on CPU: rollout.engine {type: sglang, device: cpu, python:
# .venv-sglang/bin/python} (configs/tiny-moe-sglang-cpu.yaml) and the real-SGLang tests.
#
# `pip install sglang` would pin a CUDA torch 2.14.1 and ~200 packages, so instead:
#   1. torch==2.13.0 first (the CPU build, the learner's own: PyTorch's CPU index when it answers,
#      else pip's own index, said in a line; TORCH_INDEX_URL, TORCH_SPEC override: scripts/torch_cpu.sh);
#   2. every other package from tests/sglang_cpu/requirements.txt, all pinned (torch==2.13.0 too),
#      with --no-deps (sglang 0.5.23 itself included): exactly that list, nothing resolved from
#      sglang's metadata (which asks for a CUDA torch 2.14.1 and transformers 5.19.0);
#   3. a .pth file in the venv's site-packages that puts tests/sglang_cpu/standins on sys.path
#      (import-only `torchvision`, pure-torch `sgl_kernel`) and imports
#      sglang_cpu_sitecustomize (plain host allocation instead of cudaHostRegister for the
#      routed-experts buffer). See the header of each of those files for what and why.
# Nothing outside .venv-sglang is written. Idempotent: a second run only checks (seconds).
# About 2.5 GB on disk, ~1-2 min on a fresh machine with a warm pip cache.
# --print-torch-install: where torch would come from, and the pip arguments; installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch_cpu.sh
root="$(pwd)"
venv=.venv-sglang
req=tests/sglang_cpu/requirements.txt
standins="$root/tests/sglang_cpu/standins"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
case "${1:-}" in
    "") ;;
    --print-torch-install) torch_install_args "$PYTHON"; exit 0 ;;
    *) echo "setup_sglang_cpu.sh: unknown argument $1 (use --print-torch-install)" >&2; exit 2 ;;
esac

if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv"
fi
# Keep git quiet about the venv whatever the repository's .gitignore says.
[ -f "$venv/.gitignore" ] || echo '*' > "$venv/.gitignore"

py="$venv/bin/python"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# 3. (cheap, so always) the stand-ins and the start-up patch, for every python of this venv.
printf '%s\nimport sglang_cpu_sitecustomize\n' "$standins" > "$site/sglang_cpu_standins.pth"

stamp="$venv/.sglang-cpu-installed"
want="$(cat "$req" scripts/setup_sglang_cpu.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
PIP=("$py" -m pip install --disable-pip-version-check -q)
# 1. the CPU build of torch
mapfile -t torch_args < <(torch_install_args "$py")
"${PIP[@]}" "${torch_args[@]}"
# 2. the pinned closure, without dependency resolution
"${PIP[@]}" --no-deps -r "$req"
# Sanity: the server's import graph loads and the patch is in place.
check='
import torch, sglang, sgl_kernel, torchvision
import sglang.srt.mem_cache.pool_host.common as host
import sglang.srt.managers.scheduler, sglang.srt.entrypoints.http_server
assert torch.__version__.startswith("2.13.0") and not torch.cuda.is_available(), torch.__version__
assert sglang.__version__ == "0.5.23", sglang.__version__
assert host.ALLOC_MEMORY_FUNCS["cpu"].__module__ == "sglang_cpu_sitecustomize"
assert "standin" in sgl_kernel.__version__ and "standin" in torchvision.__version__
'
if ! out="$(SGLANG_USE_CPU_ENGINE=1 "$py" -c "$check" 2>&1)"; then
    echo "$out" >&2
    echo "setup_sglang_cpu.sh: the sglang import check failed (output above)" >&2
    exit 1
fi
echo "$want" > "$stamp"
echo "ready: $venv (sglang 0.5.23 on torch $("$py" -c 'import torch; print(torch.__version__)')); use it with rollout.engine.python=$venv/bin/python (configs/tiny-moe-sglang-cpu.yaml)"
