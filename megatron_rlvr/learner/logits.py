"""Per-token logprobs and entropy from vocab-sharded logits, in chunks of tokens.

The last pipeline stage holds logits [B, T, V/tp] in the model's dtype. Computed plainly
(a float copy, Megatron's vocab-parallel cross entropy, entropy through autograd), training
keeps three fp32 [B, T, V/tp] tensors for the backward (the softmax, the tempered logits and
their exponentials) and makes more in passing, five at the peak (benchmarks/logit_memory.py):
for the Qwen3-30B-A3B recipe (micro-batch 2, T ≈ 8.7k, V/tp = 151,936/2) each is 5.3 GB,
about 26 GB.

Here one autograd function computes both per token, a chunk of rows (tokens) at a time, and
keeps for the backward only the logits it was given plus three floats and the target per
token; the backward recomputes each chunk's softmax. Peak memory above the logits themselves:

    forward:  2 · rows · V/tp · 4 bytes          (one chunk's fp32 work; rows = chunk_rows)
    backward: B · T · V/tp · dtype bytes         (the gradient, in the logits' dtype)
              + 2 · rows · V/tp · 4 bytes

rows defaults to what fits CHUNK_BYTES of fp32 per tensor (64 MiB: ~220 tokens at
V/tp = 76k): about 2.8 GB for that recipe. Results equal the plain computation's up to fp32
rounding (tests/test_learner.py, TP 1 and 2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_BYTES = 64 * 2**20


def _tp():
    from megatron.core import parallel_state as mpu

    return (
        mpu.get_tensor_model_parallel_group(),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_rank(),
    )


def _chunk_stats(z: torch.Tensor, local_target: torch.Tensor, group, tp: int):
    """For tempered logits z [n, V/tp] (fp32): the per-row max, log Σe^z, E_p[z] and the
    target's z (0 where the target is on another rank), each over the whole vocabulary."""
    peak = z.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    z.sub_(peak[:, None])  # z is the caller's own copy
    e = z.exp()
    on_rank = (local_target >= 0) & (local_target < z.shape[-1])
    picked = z.gather(-1, local_target.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1) * on_rank
    e_dot_z = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)  # Σ e·z without an [n, V] product
    sums = torch.stack([e.sum(-1), e_dot_z, picked])
    if tp > 1:
        dist.all_reduce(sums, group=group)
    log_norm = sums[0].log()
    return peak, log_norm, sums[1] / sums[0], sums[2]


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature: float, rows: int):
        group, tp, rank = _tp()
        flat = logits.reshape(-1, logits.shape[-1])
        local_targets = targets.reshape(-1) - rank * flat.shape[-1]
        logprob = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        entropy, peak, log_norm, mean_z = (torch.empty_like(logprob) for _ in range(4))
        for start in range(0, flat.shape[0], rows):
            part = slice(start, start + rows)
            z = flat[part].to(torch.float32, copy=True).div_(temperature)
            peak[part], log_norm[part], mean_z[part], picked = _chunk_stats(z, local_targets[part], group, tp)
            logprob[part] = picked - log_norm[part]
            entropy[part] = log_norm[part] - mean_z[part]
        ctx.save_for_backward(logits, local_targets, peak, log_norm, mean_z)
        ctx.temperature, ctx.rows = temperature, rows
        return logprob.view(targets.shape), entropy.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        """d logprob/dz_j = 1[j = target] − p_j;  d H/dz_j = −p_j (z_j − E_p[z]);  z = logits/τ.
        Every per-token sum over the vocabulary is saved, so no communication here."""
        logits, local_targets, peak, log_norm, mean_z = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        g_lp = grad_logprob.reshape(-1).float()
        g_h = grad_entropy.reshape(-1).float()
        for start in range(0, flat.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            z = flat[part].to(torch.float32, copy=True).div_(ctx.temperature).sub_(peak[part, None])
            p = (z - log_norm[part, None]).exp_()
            # g = −p · (g_lp + g_h · (z − E[z])), built in z's storage: two [rows, V/tp] buffers
            g = z.sub_(mean_z[part, None]).mul_(g_h[part, None]).add_(g_lp[part, None]).mul_(p).neg_()
            target = local_targets[part]
            on_rank = (target >= 0) & (target < flat.shape[-1])
            rows = torch.arange(g.shape[0], device=g.device)[on_rank]
            g[rows, target[on_rank]] += g_lp[part][on_rank]
            grad[part] = g.div_(ctx.temperature)
        return grad.view(logits.shape), None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V/tp] (this rank's vocabulary slice) → (logprob of each next token,
    entropy of each next-token distribution), both [B, T] fp32 with gradient, column 0 (no
    prediction for the first token) 0. Temperature 0 (greedy) means the raw distribution."""
    tau = temperature if temperature > 0 else 1.0
    rows = chunk_rows or max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
    # position t predicts token t + 1; the last position predicts nothing (target −1, on no
    # rank). Taking all positions keeps the logits a view: logits[:, :-1] would be copied.
    targets = torch.nn.functional.pad(input_ids[:, 1:].to(logits.device), (0, 1), value=-1)
    lp, h = _LogprobEntropy.apply(logits, targets, tau, rows)
    pad = torch.nn.functional.pad
    return pad(lp[:, :-1], (1, 0)), pad(h[:, :-1], (1, 0))
