"""Per-micro-batch memory of a learner rank: activations kept for backward, the logits and
the logprob pass, routing-replay targets and the weight-sync buckets.

Activations (bytes per token of a micro-batch, one decoder layer, `a` = dtype bytes, `sp` =
tp under sequence parallelism else 1), counting each tensor a layer keeps for its backward
once (flash attention: no s² term):

    attention   a · (2h/sp + (n_q + 2 n_kv)·d/tp + n_q·d/tp)        norm and qkv inputs, q/k/v, output
                + a · (n_q + n_kv)·d/tp                              q/k norms' inputs (Qwen3's qk-norm)
    MLA         a · (2h/sp + q_lora + kv_lora + rope + n_q·(2 d_qk + 2 d_v)/tp)
    MoE         a · (2h/sp) + 8·E/sp                                 norm input/output, fp32 router logits + probs
                + a · k·(etp·2h + 3·ffn)/tp                          each routed copy: fc1 input, fc1 out (2 ffn),
                                                                     activation, fc2 out; ÷ etp width, × etp tokens
    shared experts    a · (h/sp + 3·ffn/tp)                          input, fc1 out, activation
    dense MLP         a · (2h/sp + 3·ffn/tp)                         norm input/output, fc1 out, activation

This starts from Korthikanti et al.'s accounting (Megatron-LM's theoretical_memory_usage,
Megatron-Bridge's estimate_training_memory) and departs from it where these models do: GQA
and a query width other than h, SwiGLU's 2·ffn fc1 output, no dropout masks, and the routed
copies of each token an MoE layer keeps (docs/slurm.md compares the two term by term). With
trainer.recompute_activations (full recompute, one layer at a time, learner/model.py) a layer
keeps only its input, a·h/sp per token, and backward rebuilds one layer at a time.

Pipeline: the 1F1B schedule (no virtual stages) keeps min(pp − stage, micro-batches)
micro-batches in flight on a stage; stage 0 holds the most.

Logits (last stage, learner/logits.py): the output layer's logits [T, V/tp] in the model
dtype, kept for backward; the backward's gradient of the same size; two fp32 chunks of
CHUNK_BYTES each (the chunked logprob/entropy computation). The logprob pass keeps no graph:
logits plus the two chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlvr.plan.model_state import Layout, stage_layers
from megatron_rlvr.plan.shape import ModelShape

CHUNK_BYTES = 64 * 2**20  # learner/logits.py's CHUNK_BYTES (a test keeps them equal)
INDEX_BYTES = 8  # RouterReplay's target indices are int64 (`target.long()`)


@dataclass(frozen=True)
class Batch:
    """What one step puts through a learner rank."""

    seq_len: int  # longest row: prompt + max_new_tokens
    train_tokens: int  # tokens of one training micro-batch (rows × padded length, or the budget)
    logprob_tokens: int  # tokens of one logprob-pass micro-batch
    micro_batches: int  # training micro-batches of one mini-batch on one DP rank
    rows_per_rank: int  # rows one DP rank trains in a step (all mini-batches)
    batch_rows: int  # rows of the whole step's batch (every rank receives all of them)


def layer_bytes_per_token(shape: ModelShape, layer: int, layout: Layout, sp: int, a: int) -> int:
    h, tp, etp = shape.hidden, layout.tp, layout.etp
    if shape.mla:
        names = {p.name: p.numel for p in shape.params_of_layer(layer)}
        q_lora = names.get("self_attention.q_layernorm.weight", 0)
        d_v = names["self_attention.linear_proj.weight"] // (h * shape.num_heads)
        attn = 2 * h // sp + q_lora + shape.kv_lora_rank + shape.qk_rope_head_dim
        attn += shape.num_heads * (2 * shape.head_dim + 2 * d_v) // tp
    else:
        n_q, n_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        attn = 2 * h // sp + (n_q + 2 * n_kv) * d // tp + n_q * d // tp
        if any(p.name == "self_attention.q_layernorm.weight" for p in shape.params_of_layer(layer)):
            attn += (n_q + n_kv) * d // tp  # the q and k norms keep their inputs, the qkv output
    total = a * attn
    params = {p.name: p.numel for p in shape.params_of_layer(layer)}
    if layer in shape.moe_layers:
        total += a * 2 * h // sp + 8 * shape.num_experts // sp
        total += a * shape.top_k * (etp * 2 * h + 3 * shape.moe_ffn) // tp
        shared = params.get("mlp.shared_experts.linear_fc2.weight", 0) // h
        if shared:
            total += a * (h // sp + 3 * shared // tp)
    else:
        ffn = params["mlp.linear_fc2.weight"] // h
        total += a * (2 * h // sp + 3 * ffn // tp)
    return total


def activation_bytes(
    shape: ModelShape, layout: Layout, stage: int, tokens: int, *, sp: int, a: int, recompute: bool
) -> int:
    """Activations one micro-batch of `tokens` keeps on a rank of `stage` until its backward."""
    layers = stage_layers(shape, layout.pp, stage)
    per_layer = [layer_bytes_per_token(shape, layer, layout, sp, a) for layer in layers]
    if recompute:
        return tokens * (len(per_layer) * a * shape.hidden // sp)
    return tokens * sum(per_layer)


def recompute_working_bytes(shape: ModelShape, layout: Layout, stage: int, tokens: int, *, sp: int, a: int) -> int:
    """Under full recompute: the one layer rebuilt at a time in backward."""
    layers = stage_layers(shape, layout.pp, stage)
    return tokens * max(layer_bytes_per_token(shape, layer, layout, sp, a) for layer in layers)


def in_flight(layout: Layout, stage: int, micro_batches: int) -> int:
    return max(1, min(layout.pp - stage, micro_batches))


def logits_bytes(shape: ModelShape, layout: Layout, tokens: int, a: int, *, train: bool) -> int:
    """The last stage's logits for one micro-batch and the chunked logprob work on them."""
    vocab_local = shape.vocab // layout.tp
    rows = min(tokens, max(1, CHUNK_BYTES // (4 * vocab_local)))
    chunks = 2 * rows * vocab_local * 4
    return tokens * vocab_local * a * (2 if train else 1) + chunks


def r3_device_bytes(shape: ModelShape, layout: Layout, stage: int, tokens: int, sp: int, micro_batches: int) -> int:
    """Replay targets set on this stage's routers: int64 [tokens/sp, top_k] per MoE layer and
    micro-batch; recompute's backward queue holds those of every micro-batch in flight."""
    moe = sum(1 for layer in stage_layers(shape, layout.pp, stage) if layer in shape.moe_layers)
    return micro_batches * moe * (tokens // sp) * shape.top_k * INDEX_BYTES


def compact_bytes(num_experts: int) -> int:
    """Bytes of one expert id as rollout/routed_experts.py's compact_dtype stores it."""
    return 1 if num_experts <= 256 else 2 if num_experts <= 32768 else 4


def r3_host_bytes(shape: ModelShape, batch: Batch) -> int:
    """The step's engine routing on each learner rank's host: [rows, T, layers, top_k]."""
    return batch.batch_rows * batch.seq_len * shape.num_layers * shape.top_k * compact_bytes(shape.num_experts)


def r2_host_bytes(shape: ModelShape, layout: Layout, stage: int, batch: Batch) -> int:
    """R2's recorded routing of this rank's rows, this stage's MoE layers, on the host."""
    moe = sum(1 for layer in stage_layers(shape, layout.pp, stage) if layer in shape.moe_layers)
    return batch.rows_per_rank * batch.seq_len * moe * shape.top_k * compact_bytes(shape.num_experts)


def sync_bytes(shape: ModelShape, layout: Layout, bucket_bytes: int, a: int) -> int:
    """Weight export on a learner rank: one open bucket, plus the largest tensor gathered whole
    (a TP-merged embedding or output layer, or one expert tensor from every EP rank)."""
    layer = shape.params_of_layer(min(shape.moe_layers, default=0))
    expert = max((p.numel for p in layer if p.split == "expert"), default=0)
    return bucket_bytes + a * max(shape.vocab * shape.hidden, layout.ep * expert)
