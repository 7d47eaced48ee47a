"""The CPU engine's batched seeded sampler draws from the right distribution, filters as
SGLang's sampling params define, and gives a row the same token whatever batch it is in."""

import math

import pytest
import torch

from megatron_rlvr.rollout.protocol import SamplingParams
from megatron_rlvr.rollout.sampling import sample_rows, uniform_noise

_M64 = (1 << 64) - 1


def _splitmix64_reference(seed: int, k: int) -> int:
    """The k-th output (k ≥ 1) of splitmix64 seeded with seed, in Python integers."""
    z = (seed + k * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _allowed_reference(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens a row may draw, one filter after the other on probabilities."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    if p.top_k > 0:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    if p.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        keep = ordered.cumsum(0) - ordered < p.top_p * ordered.sum()
        probs = torch.zeros_like(probs).scatter(0, order, ordered * keep)
    return {i for i in range(len(probs)) if probs[i] > 0}


def test_noise_is_the_splitmix64_stream_of_each_seed():
    seeds, positions, vocab = [0, 7, 2**62 + 5], [0, 3, 100], 5
    noise = uniform_noise(seeds, positions, vocab)
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        for token in range(vocab):
            bits = _splitmix64_reference(seed, position * vocab + token + 1) >> 11
            assert noise[row, token].item() == (bits + 0.5) / 2**53


def test_draws_follow_the_temperature_scaled_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    params = SamplingParams(temperature=0.7)
    draws = 20_000
    tokens, logprobs = sample_rows(
        logits.expand(draws, -1).contiguous(), [params] * draws, list(range(draws)), [3] * draws
    )
    want = torch.softmax(logits / 0.7, -1)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double() / draws
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((counts - want).abs() <= 4 * sigma + 1e-9).all(), (counts, want)
    assert logprobs[0] == pytest.approx(math.log(want[tokens[0]]), abs=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.6),
        SamplingParams(temperature=1.2, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=4, top_p=0.7, min_p=0.05),
    ],
)
def test_filters_keep_exactly_the_reference_tokens_and_logprobs_are_unfiltered(params):
    generator = torch.Generator().manual_seed(1)
    for case in range(20):
        logits = torch.randn(12, generator=generator) * 2
        allowed = _allowed_reference(logits, params)
        draws = 400
        tokens, logprobs = sample_rows(
            logits.expand(draws, -1).contiguous(),
            [params] * draws,
            [case * 1000 + i for i in range(draws)],
            [0] * draws,
        )
        assert set(tokens) <= allowed
        kept = torch.softmax(logits / params.temperature, -1)[sorted(allowed)]
        likely = {t for t, p in zip(sorted(allowed), kept / kept.sum()) if p >= 0.03}
        assert likely <= set(tokens)  # each missed with probability < 1e-5 in 400 draws
        unfiltered = torch.log_softmax(logits / params.temperature, -1)
        assert logprobs == pytest.approx(unfiltered[tokens].tolist(), abs=1e-6)


def test_a_row_draws_the_same_token_in_any_batch_and_greedy_is_argmax():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=generator)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.5, 0.0, 1.3, 0.0, 0.9)]
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 5, 9, 2, 2, 40]
    together, _ = sample_rows(logits, params, seeds, positions)
    alone = [
        sample_rows(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], positions[i : i + 1])[0][0]
        for i in range(6)
    ]
    assert together == alone
    assert together[2] == int(logits[2].argmax()) and together[4] == int(logits[4].argmax())
    noise_now, noise_next = uniform_noise(seeds, positions, 30), uniform_noise(seeds, [p + 1 for p in positions], 30)
    assert not torch.isclose(noise_now, noise_next).any()  # a new position draws new noise for every token
