"""Supervised fine-tuning through the learner's pipeline schedule: masked cross-entropy, the
mean negative logprob of the assistant's tokens over a whole step.

A step's micro-batches (first-fit-decreasing groups of rows, each its own shape, or rows of
sequences packed under a block-diagonal mask: learner/packing.py) are dealt
round-robin over data-parallel ranks; under sequence parallel each is right-padded to a
multiple of tp; under pipeline parallel all take one shape (the stages exchange activations
of a fixed shape). Each micro-batch's summed loss is divided by the step's assistant-token
count, then multiplied by the factors Megatron divides by (micro-batches per rank, DP size),
so the gradient is exactly that of the step's mean loss, in any layout."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.learner.logits import logprobs_and_entropy
from megatron_rlvr.learner.packing import block_causal_mask, segment_positions
from megatron_rlvr.learner.parallel import device as rank_device


def local_micro_batches(
    micro: list[TrainBatch], *, dp: int, dp_rank: int, tp_multiple: int, same_shape: bool
) -> list[TrainBatch]:
    """This DP rank's micro-batches (the list padded with empty ones to a multiple of dp)."""
    micro = list(micro)
    while len(micro) % dp:
        empty = micro[-1].select(torch.arange(1))
        empty.response_mask = torch.zeros_like(empty.response_mask)
        micro.append(empty)
    if same_shape:
        rows = max(mb.size for mb in micro)
        width = max(mb.input_ids.shape[1] for mb in micro)
        micro = [_padded(mb, rows, width) for mb in micro]
    return [mb.padded_to(tp_multiple) for mb in micro[dp_rank::dp]]


def _padded(mb: TrainBatch, rows: int, width: int) -> TrainBatch:
    pad = (0, width - mb.input_ids.shape[1], 0, rows - mb.size)
    segments = None if mb.segments is None else torch.nn.functional.pad(mb.segments, pad, value=-1)
    return TrainBatch(
        torch.nn.functional.pad(mb.input_ids, pad), torch.nn.functional.pad(mb.response_mask, pad), segments=segments
    )


def sft_schedule(chunks, micro: list[TrainBatch], *, normalizer: float, dp: int, forward_only: bool) -> list[dict]:
    """Forward (and backward unless forward_only) of this rank's micro-batches; the loss
    dicts of the last pipeline stage."""
    scale = len(micro) * dp

    def loss_fn(mb: TrainBatch, output: torch.Tensor):
        logprobs, _ = logprobs_and_entropy(output, mb.input_ids)
        mask = mb.response_mask.to(output.device)
        loss = -(logprobs * mask).sum() / normalizer
        return loss * scale, {"sft_loss": loss.detach(), "tokens": mask.sum().detach()}

    if forward_only:
        with torch.no_grad():
            return _schedule(chunks, micro, loss_fn, forward_only=True)
    return _schedule(chunks, micro, loss_fn, forward_only=False)


def _schedule(chunks, micro: list[TrainBatch], loss_fn, *, forward_only: bool) -> list[dict]:
    """Megatron's schedule over micro-batches of their own widths (positions per micro-batch;
    under pipeline parallel they share one shape, see local_micro_batches)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = rank_device()

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        ids = mb.input_ids.to(device)
        if mb.segments is None:
            positions, mask = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids), None
        else:  # packed rows (sft.pack_sequences): each sequence attends only to itself
            positions, mask = segment_positions(mb.segments).to(device), block_causal_mask(mb.segments).to(device)
        return model(ids, positions, mask), partial(loss_fn, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=chunks,
        num_microbatches=len(micro),
        seq_length=max(mb.input_ids.shape[1] for mb in micro),
        micro_batch_size=max(mb.size for mb in micro),
        forward_only=forward_only,
    )


def reduce_loss(per_micro: list[dict]) -> dict[str, float]:
    """The step's mean loss and its token count, the same on every rank (counted on the last
    pipeline stage's first TP rank only)."""
    from megatron.core import parallel_state as mpu

    counts = mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0
    sums = torch.zeros(2, dtype=torch.float64)
    for m in per_micro if counts else []:
        sums += torch.tensor([float(m["sft_loss"]), float(m["tokens"])], dtype=torch.float64)
    sums = sums.to(rank_device())
    dist.all_reduce(sums)
    return {"sft_loss": float(sums[0]), "sft_tokens": float(sums[1])}
