#!/usr/bin/env bash
# scripts/gpu_check.py on a GPU machine that has its own Python with torch (but no network, so no
# setup.sh --gpu): the learner-side wheels (megatron-core, mbridge, pydantic, ...) are installed from
# ./wheels into /tmp/site, and the steps run with that Python (GPU_CHECK_PYTHON). Run from a copy of
# the repository that holds wheels/ (docs/gpu-check-report.md says how it was used):
#   OUT=/some/dir bash scripts/gpu_check_device.sh          (DRY=1: no wheels, CPU: the script's logic)
# Three passes, each bounded:
#   A  as the project ships: parallel.device=cuda without transformer-engine is refused (the record)
#   B  MEGATRON_RLVR_CUDA_LOCAL_SPEC=1: Megatron-Core's local spec on CUDA, the learner steps
#   C  the same, the steps that need transformer-engine or SGLang (missing here: they fail saying so)
# Every pass runs --keep-going; each step and each pass is bounded (TOTAL_S in all).
# Writes into $OUT (8 files at most come back from the device): env.txt, summary.txt, logs.tar.gz,
# REPORT-A.md, REPORT-B.md, REPORT-C.md, REPORT-B.json, REPORT-C.json.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT}"
PYBIN="${PYBIN:-python3}"
TOTAL_S="${TOTAL_S:-480}"   # the whole script's budget (measured on an H200: about 430 s): each pass gets what is left of it
STEP_S="${STEP_S:-200}"     # each learner step's limit (gpu_check's own are 30 min; the checkpoint step took 150 s)
ENGINE_S="${ENGINE_S:-45}"  # sglang-gpu and train: SGLang is not installed, they fail at its start
mkdir -p "$OUT"
began=$(date +%s)
{
  echo "== $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  uname -r
} >"$OUT/env.txt" 2>&1
if [ "${DRY:-0}" != 1 ]; then
  "$PYBIN" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl \
    >>"$OUT/env.txt" 2>&1 || { echo "wheel install failed" | tee -a "$OUT/env.txt"; exit 3; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYBIN" - >>"$OUT/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], sys.executable)
import megatron_rlvr
print("megatron_rlvr from", megatron_rlvr.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
for name in ("megatron-core", "mbridge", "pydantic", "pydantic-core", "transformers", "numpy", "safetensors",
             "einops", "pytest", "pytest-timeout", "sympy", "pyyaml", "httpx", "psutil", "ray", "fastapi",
             "uvicorn", "sglang", "transformer-engine", "transformer_engine_torch"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
EOF
export GPU_CHECK_PYTHON="$(command -v "$PYBIN")" PYTHONUNBUFFERED=1
# only the files that hold gpu tests are collected (the others import ray, fastapi, ...: not here);
# pytest keeps every session's tmp folders, where the workers' rank*.json (the figures) are
export PYTEST_ADDOPTS="tests/test_learner.py tests/test_routing_replay.py tests/test_packing.py -o tmp_path_retention_count=100"
check() {  # pass-name, time limit per step, seconds to leave for what follows, steps
  local name=$1 limit=$2 reserve=$3 steps=$4
  local left=$((TOTAL_S - ($(date +%s) - began) - reserve))
  [ "$left" -lt 20 ] && { echo "[device] $name: not run, ${left} s left" | tee -a "$OUT/env.txt"; return; }
  echo "[device] $name: $steps (each step at most $limit s, the pass $left s; $(($(date +%s) - began)) s in)"
  GPU_CHECK_TIMEOUT_S=$limit timeout -k 5 "$left" "$PYBIN" scripts/gpu_check.py --skip-setup --keep-going \
    --only "$steps" --out "$OUT/$name"
  echo "[device] $name: exit $? after $(($(date +%s) - began)) s"
}
check A 60 $((TOTAL_S - 90)) inventory,learner-hf
MEGATRON_RLVR_CUDA_LOCAL_SPEC=1 check B "$STEP_S" $((ENGINE_S * 3 + 15)) inventory,learner-hf,replay,checkpoint,learner-gpu
MEGATRON_RLVR_CUDA_LOCAL_SPEC=1 check C "$ENGINE_S" 10 packed,sglang-gpu,train,submit
echo "[device] all passes done in $(($(date +%s) - began)) s"
for pass in A B C; do
  [ -f "$OUT/$pass/REPORT.md" ] && cp "$OUT/$pass/REPORT.md" "$OUT/REPORT-$pass.md"
  [ "$pass" != A ] && [ -f "$OUT/$pass/REPORT.json" ] && cp "$OUT/$pass/REPORT.json" "$OUT/REPORT-$pass.json"
done  # 8 files at most come back: env, summary, logs, 3 REPORT-*.md, 2 REPORT-*.json
{
  for pass in A B C; do
    echo "== pass $pass"
    grep '^| ' "$OUT/$pass/REPORT.md" 2>/dev/null
  done
  echo "== worker results (rank*.json under pytest's tmp folders)"
  find /tmp/pytest-of-* -name 'rank*.json' 2>/dev/null | sort
} >"$OUT/summary.txt"
results=$(find /tmp/pytest-of-* \( -name 'rank*.json' -o -name 'rank*.log' -o -name '*.log' \) 2>/dev/null)
tar czf "$OUT/logs.tar.gz" --exclude="*.safetensors" -C "$OUT" A B C $(for f in $results; do echo "-C / ${f#/}"; done) 2>/dev/null
rm -rf "$OUT/A" "$OUT/B" "$OUT/C"
cat "$OUT/summary.txt"
