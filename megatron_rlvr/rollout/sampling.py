"""Seeded sampling of a whole decode step at once, for the CPU engine.

Every row is sampled by the Gumbel-max trick, argmax(log p + Gumbel noise) over the tokens its
filters keep, which draws exactly from the filtered, renormalised distribution. The noise of a
row is a pure function of (its seed, its output position, the token id): the splitmix64 stream
of its seed, one value per (position, token). So a sample's tokens depend on its seed alone, not
on the batch it ran in, the step it joined at, or a retract and re-prefill; and the batch is
sampled with a handful of tensor operations instead of a Python loop over rows (at 64 rows the
loop cost a quarter of the model's forward). Logprobs are of log_softmax(logits / T), before
the filters (raw logits when T = 0), as SGLang reports them.
"""

from __future__ import annotations

import torch

from megatron_rlvr.rollout.protocol import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's increment, as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_SEED_MASK = (1 << 63) - 1


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function; int64 multiplication wraps as uint64's would."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def uniform_noise(seeds: list[int], positions: list[int], vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 in (0, 1): value k = position · vocab + token + 1 of the splitmix64
    stream seeded with each row's seed."""
    seed = torch.tensor([s & _SEED_MASK for s in seeds], dtype=torch.int64)[:, None]
    counter = torch.tensor(positions, dtype=torch.int64)[:, None] * vocab + torch.arange(1, vocab + 1)
    bits = _shift_right(_splitmix64(seed + counter * _GOLDEN), 11)  # the top 53 bits
    return (bits.double() + 0.5) / float(1 << 53)


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> tuple[list[int], list[float]]:
    """One token per row of logits [rows, vocab] (float32) under each row's sampling params and
    seed, at each row's output position; returns the tokens and their logprobs."""
    vocab = logits.shape[1]
    constraints = [p._constraint for p in params]  # a constrained reply: only the tokens it allows
    if any(c is not None for c in constraints):
        logits = torch.stack(
            [
                row if c is None else row.masked_fill(~c.mask(vocab), float("-inf"))
                for row, c in zip(logits, constraints)
            ]
        )
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    greedy = temperature == 0.0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    keep = _filter_mask(logp, params)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, vocab))).to(logp.dtype)
    drawn = torch.where(keep, logp + gumbel, float("-inf")).argmax(-1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    for constraint, token in zip(constraints, tokens.tolist()):
        if constraint is not None:
            constraint.advance(token)
    return tokens.tolist(), logp.gather(1, tokens[:, None])[:, 0].tolist()


def _filter_mask(logp: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The tokens each row may draw: top-k (ties kept), then min-p, then top-p of what is left
    (the smallest set, most probable first, whose mass reaches top_p of it)."""
    keep = torch.ones_like(logp, dtype=torch.bool)
    top_k = torch.tensor([p.top_k for p in params])
    if (top_k > 0).any():
        ordered = logp.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (top_k.clamp(1, logp.shape[1]) - 1)[:, None])
        keep &= (logp >= kth) | (top_k <= 0)[:, None]
    min_p = torch.tensor([p.min_p for p in params], dtype=logp.dtype)
    if (min_p > 0).any():
        keep &= logp >= torch.log(min_p)[:, None] + logp.max(-1, keepdim=True).values
    top_p = torch.tensor([p.top_p for p in params], dtype=logp.dtype)
    if (top_p < 1.0).any():
        probs = torch.where(keep, logp.exp(), 0.0)
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered
        within = before < top_p[:, None] * ordered.sum(-1, keepdim=True)
        keep &= torch.zeros_like(keep).scatter(1, order, within) | (top_p >= 1.0)[:, None]
    return keep
