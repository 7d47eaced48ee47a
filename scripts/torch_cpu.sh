# Sourced by setup.sh and setup_sglang_cpu.sh: how torch's CPU build is installed, said in one line.
#
# PyPI's torch==2.13.0 is the CUDA build (gigabytes of nvidia-* wheels); the CPU build lives on
# PyTorch's own index. So:
#   TORCH_INDEX_URL unset     PyTorch's CPU index (https://download.pytorch.org/whl/cpu) when it
#                             answers within 3 s; otherwise pip's own configuration, with a line
#                             saying so (a machine whose pip serves the CPU build: a mirror, a
#                             wheel folder; elsewhere that is the CUDA build).
#   TORCH_INDEX_URL=URL       that index, checked the same way.
#   TORCH_INDEX_URL=          (empty) pip's own configuration, no check.
#   TORCH_SPEC                what to install (default torch==2.13.0, the version constraints.txt holds).

TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# torch_install_args PYTHON: prints the pip arguments (one per line) and says on stderr where
# torch comes from. PYTHON (any interpreter) runs the reachability check.
torch_install_args() {
    local probe_python="$1" spec="${TORCH_SPEC:-torch==2.13.0}"
    local index="${TORCH_INDEX_URL-$TORCH_CPU_INDEX}"
    if [ -z "$index" ]; then
        echo "torch: $spec from pip's configured index (TORCH_INDEX_URL is empty)" >&2
        printf '%s\n' "$spec"
        return
    fi
    local check='import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/", timeout=3)'
    if timeout 4 "$probe_python" -c "$check" "$index" >/dev/null 2>&1; then
        echo "torch: $spec, CPU build, from $index" >&2
        printf '%s\n' --index-url "$index" "$spec"
    else
        echo "torch: $index is not reachable (3 s check); $spec from pip's configured index instead" \
            "(the CPU build only if that index serves it; set TORCH_INDEX_URL to choose)" >&2
        printf '%s\n' "$spec"
    fi
}
