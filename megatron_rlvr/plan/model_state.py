"""Bytes of the learner's model state on one rank: parameters, gradients, optimizer state.

This follows what learner/learner.py builds with Megatron-Core 0.16:

- `DistributedDataParallel(grad_reduce_in_fp32=True, overlap_grad_reduce=False)`: one fp32
  gradient buffer per (parameter dtype, expert or not), one bucket each (no overlap: no
  bucket size), except that a tied embedding split over pipeline stages gets a bucket of its
  own under the distributed optimizer. With the distributed optimizer the parameters also
  live in a buffer of their dtype, every parameter starts at a multiple of 64 elements and
  every bucket ends at a multiple of lcm(its data-parallel size, 128).
- Dense parameters reduce over DP (= data_parallel_size); routed experts over expert-DP =
  tp·dp / (ep·etp), the ranks of one pipeline stage that hold the same experts.
- Adam: fp32 exp_avg and exp_avg_sq per optimised element; a 16-bit parameter gets an fp32
  master copy, an fp32 parameter is optimised in place. With the distributed optimizer each
  data-parallel rank optimises its shard of every bucket (the parameters' elements inside
  it, padding left out); without it every rank optimises everything.

So a bf16 parameter costs 2 + 4 + 12 bytes without the distributed optimizer and
2 + 4 + 12/shard with it (the notes' 18 and 6 + 12/shard); a fp32 one 4 + 4 + 8(/shard).
Norm weights are fp32 under the CPU learner (torch's RMSNorm, learner/cpu_compat.py) and in
the model's dtype under transformer-engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rlvr.plan.shape import ModelShape, Param

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int

    @property
    def expert_dp(self) -> int:
        return self.tp * self.dp // (self.ep * self.etp)

    def text(self) -> str:
        return f"tp {self.tp} · pp {self.pp} · dp {self.dp} · ep {self.ep} · etp {self.etp}"


@dataclass(frozen=True)
class RankParam:
    name: str
    numel: int  # on this rank
    dtype: str
    expert: bool
    shared_embedding: bool = False


@dataclass(frozen=True)
class StateBytes:
    """One rank's model state, with the element counts behind it."""

    params: int
    grads: int
    optimizer: int  # master copies + Adam moments
    dense_numel: int  # parameter elements on this rank, unpadded
    expert_numel: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def stage_layers(shape: ModelShape, pp: int, stage: int) -> range:
    """Megatron's even split of the decoder layers over pipeline stages."""
    per = shape.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def rank_params(shape: ModelShape, layout: Layout, stage: int, dtype: str, norms_fp32: bool) -> list[RankParam]:
    """This stage's parameters on one rank, in Megatron's registration order."""

    def local(p: Param, prefix: str) -> RankParam:
        numel = p.numel // layout.tp if p.split == "tp" else p.numel // layout.etp if p.split == "expert" else p.numel
        kind = "float32" if p.norm and norms_fp32 else dtype
        return RankParam(prefix + p.name, numel, kind, p.split == "expert")

    first, last = stage == 0, stage == layout.pp - 1
    shared = shape.tied and layout.pp > 1
    out: list[RankParam] = []
    if first:
        emb = local(shape.embedding(), "")
        out.append(RankParam(emb.name, emb.numel, emb.dtype, False, shared_embedding=shared))
    local_experts = shape.num_experts // layout.ep
    for layer in stage_layers(shape, layout.pp, stage):
        prefix = f"decoder.layers.{layer}."
        params = shape.params_of_layer(layer)
        out += [local(p, prefix) for p in params if p.split != "expert"]
        experts = [p for p in params if p.split == "expert"]
        for e in range(local_experts):
            out += [local(p, f"{prefix}mlp.experts.local_experts.{e}.") for p in experts]
    if last:
        out.append(local(shape.final_norm(), ""))
        if not shape.tied or layout.pp > 1:
            head = local(shape.output_layer(), "")
            out.append(RankParam(head.name, head.numel, head.dtype, False, shared_embedding=shared))
    return out


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def buckets(params: list[RankParam], dp_size: int, distributed: bool) -> list[tuple[int, list[tuple[int, int]]]]:
    """Megatron's buckets of one buffer: (padded size, [(start, end) of each parameter]).
    Parameters are laid out in reverse registration order (backward order)."""
    if not distributed:
        return [(sum(p.numel for p in params), [])]
    result: list[tuple[int, list[tuple[int, int]]]] = []
    ranges: list[tuple[int, int]] = []
    start = bucket_start = 0
    end_pad = math.lcm(dp_size, 128)
    for p in reversed(params):
        start = _pad(start, 64)
        if p.shared_embedding and ranges:
            start = _pad(start, end_pad)
            result.append((start - bucket_start, ranges))
            ranges, bucket_start = [], start
        ranges.append((start - bucket_start, start - bucket_start + p.numel))
        start += p.numel
        if p.shared_embedding:
            start = _pad(start, end_pad)
            result.append((start - bucket_start, ranges))
            ranges, bucket_start = [], start
    if ranges:
        start = _pad(start, end_pad)
        result.append((start - bucket_start, ranges))
    return result


def _shard_numel(bucket: tuple[int, list[tuple[int, int]]], dp_size: int, rank: int) -> int:
    """Parameter elements of a bucket inside one data-parallel rank's shard."""
    size, ranges = bucket
    shard = size // dp_size
    lo, hi = rank * shard, (rank + 1) * shard
    return sum(max(0, min(hi, end) - max(lo, begin)) for begin, end in ranges)


def state_bytes(
    shape: ModelShape, layout: Layout, stage: int, *, dtype: str, distributed: bool, norms_fp32: bool
) -> StateBytes:
    """The model state of the most loaded rank of one pipeline stage."""
    params = rank_params(shape, layout, stage, dtype, norms_fp32)
    param_bytes = grad_bytes = optim_bytes = 0
    for expert, dp_size in ((False, layout.dp), (True, layout.expert_dp)):
        for kind in sorted({p.dtype for p in params if p.expert == expert}):
            group = [p for p in params if p.expert == expert and p.dtype == kind]
            size = DTYPE_BYTES[kind]
            per_element = 8 + (4 if size < 4 else 0)  # Adam moments + fp32 master of a 16-bit param
            layout_ = buckets(group, dp_size, distributed)
            padded = sum(b[0] for b in layout_)
            param_bytes += (padded if distributed else sum(p.numel for p in group)) * size
            grad_bytes += padded * 4
            if distributed:
                optim_bytes += per_element * max(
                    sum(_shard_numel(b, dp_size, r) for b in layout_) for r in range(dp_size)
                )
            else:
                optim_bytes += per_element * sum(p.numel for p in group)
    return StateBytes(
        params=param_bytes,
        grads=grad_bytes,
        optimizer=optim_bytes,
        dense_numel=sum(p.numel for p in params if not p.expert),
        expert_numel=sum(p.numel for p in params if p.expert),
    )
