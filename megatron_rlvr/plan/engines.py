"""One SGLang engine GPU: weights, KV cache, the memory outside SGLang's static pool; and the
weight sync's size and time.

SGLang sizes its static pool as mem_fraction_static × the GPU's memory: the weights first,
the KV cache takes the rest. Outside the pool are the forward's activations, the CUDA-graph
pools and the receive buffer of a weight-sync bucket.

    weights / GPU    (TP-split and expert weights) / engine tp + replicated weights (norms,
                     routers, MLA down projections), in the engine dtype; the embedding and
                     output layer are vocab-parallel (÷ tp). Experts ÷ tp whether SGLang splits
                     them by width (ep 1) or by count (ep = tp).
    KV / token / GPU 2 · layers · max(1, n_kv / tp) · d_head · bytes: KV heads are replicated
                     once tp exceeds them. MLA (DeepSeek-V3) caches the compressed latent,
                     (kv_lora_rank + rope_dim) · layers · bytes, on every TP rank.
    KV pool          mem_fraction_static · GPU − weights; concurrent tokens = pool / KV per token.
    outside the pool CUDA_GRAPH_RESERVE for activations and CUDA graphs (SGLang's own guidance:
                     lower mem_fraction_static when graph capture runs out) plus one sync bucket.

Weight sync: every learner parameter, in the engine dtype, reaches every engine once per
step, in buckets of weight_sync.bucket_mb; at --link-gbps a broadcast takes bytes · 8 / rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlvr.plan.model_state import DTYPE_BYTES
from megatron_rlvr.plan.shape import ModelShape

GB = 10**9
CUDA_GRAPH_RESERVE = 3 * GB  # assumed room for the decode activations and CUDA-graph pools
# assumed link rate of a weight-sync broadcast by transport, Gb/s (override: --link-gbps)
LINK_GBPS = {"nccl": 100.0, "gloo": 10.0}


@dataclass(frozen=True)
class EngineMemory:
    weights: int
    kv_per_token: int
    kv_pool: int  # what mem_fraction_static leaves after the weights (may be negative)
    outside_pool: int  # needed outside the static pool
    outside_room: int  # (1 − mem_fraction_static) · GPU
    static: int  # mem_fraction_static · GPU

    @property
    def concurrent_tokens(self) -> int:
        return max(0, self.kv_pool) // self.kv_per_token


def engine_weights(shape: ModelShape, tp: int, dtype: str) -> int:
    size = DTYPE_BYTES[dtype]
    numel = 2 * shape.vocab * shape.hidden // tp if not shape.tied else shape.vocab * shape.hidden // tp
    numel += shape.hidden  # final norm
    for layer in range(shape.num_layers):
        for p in shape.params_of_layer(layer):
            if p.split == "expert":
                numel += p.numel * shape.num_experts // tp
            elif p.split == "tp":
                numel += p.numel // tp
            else:
                numel += p.numel
    return numel * size


def kv_bytes_per_token(shape: ModelShape, tp: int, dtype: str) -> int:
    size = DTYPE_BYTES[dtype]
    if shape.mla:
        return (shape.kv_lora_rank + shape.qk_rope_head_dim) * shape.num_layers * size
    heads = max(1, shape.num_kv_heads // tp)
    return 2 * shape.num_layers * heads * shape.head_dim * size


def engine_memory(
    shape: ModelShape, *, tp: int, dtype: str, mem_fraction_static: float, gpu_bytes: int, bucket_bytes: int
) -> EngineMemory:
    weights = engine_weights(shape, tp, dtype)
    static = int(mem_fraction_static * gpu_bytes)
    return EngineMemory(
        weights=weights,
        kv_per_token=kv_bytes_per_token(shape, tp, dtype),
        kv_pool=static - weights,
        outside_pool=CUDA_GRAPH_RESERVE + bucket_bytes,
        outside_room=gpu_bytes - static,
        static=static,
    )


@dataclass(frozen=True)
class SyncCost:
    bytes: int
    buckets: int
    seconds: float
    link_gbps: float


def sync_cost(shape: ModelShape, *, dtype: str, bucket_bytes: int, link_gbps: float) -> SyncCost:
    total = shape.total_params() * DTYPE_BYTES[dtype]
    return SyncCost(
        bytes=total, buckets=-(-total // bucket_bytes), seconds=total * 8 / (link_gbps * 1e9), link_gbps=link_gbps
    )
