"""Stand-in for `sgl_kernel` (the sglang-kernel package), for the CPU SGLang test server only.

Replaces: sglang-kernel's CPU build (C++/AVX-512 ops registered as torch.ops.sgl_kernel.*).
Why: with SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports two of its ops unconditionally at
module level (sglang.srt.mem_cache.allocation imports `assign_req_to_token_pool_cpu`,
sglang.kernels.ops.kvcache.cache_move imports `copy_all_layer_kv_cache_cpu`), but the CPU
build is not published on PyPI (the `sglang-kernel` wheel there is CUDA-only).

What it provides: pure-torch versions of those two functions, same signatures as the call
sites use, plus placeholders that raise NotImplementedError for the other CPU ops SGLang
imports at module level under `if _is_cpu:` (speculative decoding: build_tree_kernel_efficient_cpu,
verify_tree_greedy_cpu, fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu,
rotate_input_ids_cpu, assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu;
linear-attention models: sgl_kernel.mamba.*), so those modules import and fail only if used. Nothing is registered under torch.ops.sgl_kernel, so SGLang's probes for the
optimized CPU kernels (`cpu_has_amx_support()` looks for torch.ops.sgl_kernel.convert_weight_packed)
stay false and every other CPU op falls back to SGLang's plain-torch paths. Any other name is
absent, so `from sgl_kernel import X` raises ImportError like an install without X would.
Lives on sys.path only inside .venv-sglang (scripts/setup_sglang_cpu.sh).
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+sglang.cpu.standin"

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
]


def _not_implemented(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not available in the pure-torch sgl_kernel stand-in "
            "(tests/sglang_cpu/standins/sgl_kernel); sglang-kernel's CPU build is not on PyPI. "
            "The CPU SGLang test server supports plain decoding of standard-attention models only."
        )

    op.__name__ = op.__qualname__ = name
    return op


# Speculative decoding (EAGLE / tree) CPU ops: imported at module level, unused here.
assign_draft_cache_locs_contiguous_cpu = _not_implemented("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_implemented("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _not_implemented("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _not_implemented("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_implemented("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _not_implemented("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _not_implemented("verify_tree_greedy_cpu")


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    end[i]-start[i] entries of out_cache_loc (requests packed back to back, in order).
    Same contract as the Triton kernel `assign_req_to_token_pool` in
    sglang/srt/mem_cache/allocation.py."""
    del pool_len  # the row length of req_to_token; implied by its shape here
    start = start_offset.to(torch.int64).reshape(-1)
    lengths = (end_offset.to(torch.int64).reshape(-1) - start).clamp_min(0)
    total = int(lengths.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64).reshape(-1), lengths)
    seg_begin = torch.cumsum(lengths, 0) - lengths  # where each request starts in out_cache_loc
    cols = (
        torch.arange(total, dtype=torch.int64)
        - torch.repeat_interleave(seg_begin, lengths)
        + torch.repeat_interleave(start, lengths)
    )
    req_to_token[rows, cols] = out_cache_loc.reshape(-1)[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every KV buffer b (base address data_ptrs[b], row size strides[b] bytes): copy row
    src_loc[j] onto row tgt_loc[j] for all j, reading every source row before writing (safe
    when the sets overlap), like the Triton kernel `copy_all_layer_kv_cache_tiled`."""
    src = src_loc.to(torch.int64).reshape(-1)
    tgt = tgt_loc.to(torch.int64).reshape(-1)
    if src.numel() == 0:
        return
    n_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (n_rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, int(stride))
        buf[tgt] = buf[src]  # advanced indexing on the right makes a copy first
