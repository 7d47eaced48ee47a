"""Forward passes through Megatron's pipeline schedules: per-token logprobs (forward only)
and one mini-batch of policy-gradient training (forward + backward over micro-batches).

Logprobs and entropy come from learner/logits.py: under TP each rank holds a slice of the
vocabulary and only per-token maxima and sums cross ranks, never the full-vocab logits; they
are computed a chunk of tokens at a time, which bounds the last stage's logit-side memory.
A packed micro-batch (trainer.pack_sequences, learner/packing.py) runs as one sequence with
PackedSeqParams; its logprobs and entropy are unpacked to the [B, W] layout before the loss.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_rlvr.algo.from_config import loss_options
from megatron_rlvr.algo.losses import AGGREGATIONS, policy_loss
from megatron_rlvr.algo.metrics import masked_mean
from megatron_rlvr.config import AlgoConfig
from megatron_rlvr.learner.batch import MicroBatch, TrainBatch
from megatron_rlvr.learner.logits import logprobs_and_entropy
from megatron_rlvr.learner.packing import pack, packed_positions, packed_seq_params, unpack
from megatron_rlvr.learner.parallel import device as rank_device


class MicroBatchHooks(Protocol):
    """Called around each micro-batch's forward on this rank (routing replay uses it)."""

    def before_forward(self, mb: MicroBatch) -> None: ...

    def after_forward(self, mb: MicroBatch, output: torch.Tensor) -> None: ...


def model_inputs(mb: MicroBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(token ids, position ids, extra forward kwargs) of a micro-batch: [B, W] rows, or packed
    [1, total] with position ids restarting per row and the PackedSeqParams."""
    if mb.packed is None:
        ids = mb.data.input_ids.to(device)
        return ids, torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids), {}
    ids = pack(mb.data.input_ids, mb.packed).to(device)
    return ids, packed_positions(mb.packed).to(device), {"packed_seq_params": packed_seq_params(mb.packed, device)}


def token_stats(mb: MicroBatch, output: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropy [B, W] of the micro-batch's rows from the last stage's output."""
    if mb.packed is None:
        return logprobs_and_entropy(output, mb.data.input_ids, temperature)
    logprobs, entropy = logprobs_and_entropy(output, pack(mb.data.input_ids, mb.packed), temperature)
    width = mb.data.input_ids.shape[1]
    return unpack(logprobs, mb.packed, width), unpack(entropy, mb.packed, width)


def run_schedule(
    chunks,
    micro: list[MicroBatch],
    loss_fn,
    *,
    forward_only: bool,
    collect: bool,
    hooks: MicroBatchHooks | None = None,
):
    """One schedule call over the micro-batches. Their shapes may differ (token budgets): the
    pipeline then sends each activation's shape ahead of it (variable_seq_lengths, which the
    learner turns on for budgeted pipelines)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = rank_device()

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        ids, positions, extra = model_inputs(mb, device)
        if hooks is not None:
            hooks.before_forward(mb)
        output = model(ids, positions, None, **extra)
        if hooks is not None:
            hooks.after_forward(mb, output)
        return output, partial(loss_fn, mb)

    first = micro[0]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=chunks,
        num_microbatches=len(micro),
        seq_length=first.packed.total if first.packed is not None else first.data.input_ids.shape[1],
        micro_batch_size=1 if first.packed is not None else first.data.size,
        forward_only=forward_only,
        collect_non_loss_data=collect,
    )


def forward_logprobs(
    chunks, micro: list[MicroBatch], temperature: float, hooks: MicroBatchHooks | None = None
) -> list[torch.Tensor] | None:
    """Logprobs [rows, width] of each of this rank's micro-batches on the last pipeline stage,
    else None."""
    from megatron.core import parallel_state as mpu

    def collect(mb, output, non_loss_data=True):
        return token_stats(mb, output, temperature)[0].detach()

    with torch.no_grad():
        outputs = run_schedule(chunks, micro, collect, forward_only=True, collect=True, hooks=hooks)
    return list(outputs) if mpu.is_pipeline_last_stage() else None  # on the rank's device


def step_normalizer(batch: TrainBatch, agg: str) -> float:
    """The global count a mini-batch's loss divides by, known before the micro-batch loop:
    response tokens (token-mean) or non-empty sequences (the sequence means), of those the
    step's rollout rejection keeps."""
    mask = loss_tokens(batch)
    if agg == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def loss_tokens(batch: TrainBatch) -> torch.Tensor:
    """The response tokens that enter the loss: the response mask less rejected tokens."""
    return batch.response_mask if batch.kept is None else batch.response_mask * batch.kept.to(batch.response_mask)


def train_minibatch(
    chunks,
    micro: list[MicroBatch],
    algo: AlgoConfig,
    *,
    normalizer: float,
    sum_norm_divisor: float,
    temperature: float,
    correction_batch_mean: float | None = None,
    hooks: MicroBatchHooks | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Forward+backward of one mini-batch's micro-batches; gradients accumulate in the DDP
    buffers. Each micro-batch's loss is divided by the whole mini-batch's global count, then
    multiplied back by the factors Megatron divides by (micro-batch count, and DP size in the
    gradient all-reduce), so the summed gradient is exactly that of the global loss."""
    from megatron.core import parallel_state as mpu

    scale = len(micro) * mpu.get_data_parallel_world_size()
    options = loss_options(algo)

    def loss_fn(micro_batch, output):
        device = output.device
        logprobs, entropy = token_stats(micro_batch, output, temperature)
        mb = micro_batch.data
        mask = mb.response_mask.to(device)
        if algo.agg == "seq-mean-token-sum-norm":
            agg_normalizer = sum_norm_divisor
        else:
            agg_normalizer = normalizer
        rollout = mb.rollout_logprobs.to(device) if mb.rollout_logprobs is not None else None
        loss, metrics = policy_loss(
            logprobs,
            mb.old_logprobs.to(device),
            mb.advantages.to(device),
            mask,
            agg_normalizer=agg_normalizer,
            rollout_logprobs=rollout,
            correction_batch_mean=correction_batch_mean,
            **options,
        )
        kept = loss_tokens(mb).to(device)
        if algo.entropy_coef:  # a bonus: higher entropy lowers the loss, against collapse
            loss = loss - algo.entropy_coef * AGGREGATIONS[algo.agg](entropy, kept, agg_normalizer)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if algo.agg == "seq-mean-token-sum-norm":  # its mean over sequences is per call
            local_seqs = (kept.sum(-1) > 0).sum().clamp(min=1)
            loss = loss * local_seqs / max(normalizer, 1.0)
        metrics["policy_loss"] = loss.detach()
        metrics["tokens"] = mask.sum().detach()
        return loss * scale, metrics

    return run_schedule(chunks, micro, loss_fn, forward_only=False, collect=False, hooks=hooks)


def reduce_metrics(per_micro: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Token-weighted means over micro-batches and data-parallel ranks (maxima for *_max,
    sums for policy_loss), the same on every rank, whichever pipeline stage computed them."""
    from megatron.core import parallel_state as mpu

    names = METRIC_NAMES
    counts_here = mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0
    # built on the host, reduced on the rank's device (NCCL's default group takes no CPU tensor)
    sums = torch.zeros(len(names) + 1, dtype=torch.float64)  # last slot: tokens
    maxima = torch.full((len(names),), -float("inf"), dtype=torch.float64)
    present = torch.zeros(len(names), dtype=torch.float64)
    for m in per_micro if counts_here else []:
        tokens = float(m["tokens"])
        sums[-1] += tokens
        for i, key in enumerate(names):
            if key not in m:
                continue
            present[i] = 1.0
            value = float(m[key])
            if key.endswith("_max"):
                maxima[i] = max(float(maxima[i]), value)
            else:
                sums[i] += value if key == "policy_loss" else value * tokens
    device = rank_device()
    sums, maxima, present = (t.to(device) for t in (sums, maxima, present))
    for tensor, op in ((sums, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX), (present, dist.ReduceOp.MAX)):
        dist.all_reduce(tensor, op=op)
    sums, maxima, present = (t.cpu() for t in (sums, maxima, present))
    total = max(float(sums[-1]), 1.0)
    out = {}
    for i, key in enumerate(names):
        if not present[i]:
            continue
        if key.endswith("_max"):
            out[key] = float(maxima[i])
        else:
            out[key] = float(sums[i]) if key == "policy_loss" else float(sums[i]) / total
    return out


METRIC_NAMES = (  # every metric the loss reports, in one order all ranks agree on
    "approx_kl",
    "clipfrac",
    "clipfrac_high_side",
    "clipfrac_low_side",
    "clipfrac_lower",
    "clipfrac_neg",
    "clipfrac_pos",
    "entropy",
    "mismatch_abs_max",
    "mismatch_abs_mean",
    "mismatch_k3_kl",
    "policy_loss",
    "ratio_max",
    "ratio_mean",
    "rollout_is_clipfrac",
    "rollout_is_clipfrac_neg",
    "rollout_is_clipfrac_pos",
    "rollout_is_max",
    "rollout_is_mean",
    "rollout_is_mean_neg",
    "rollout_is_mean_pos",
    "rollout_rs_masked_fraction",
    "rollout_rs_masked_fraction_neg",
    "rollout_rs_masked_fraction_pos",
    "rollout_rs_seq_masked_fraction",
)
