"""The parity probe after each sync: a fixed prompt's logprobs from every engine against the
learner's for the same tokens. A sync that silently broke the weights (a wrong transpose, a
missing expert, the "gibberish after the first sync" bug) shows up here as a large
difference, and the run stops naming the engine and the size of the gap."""

from __future__ import annotations

import asyncio

import torch

from megatron_rlvr.errors import UserError
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient


class ParityError(UserError):
    """An engine's logprobs disagree with the learner's after a sync."""


async def engine_samples(
    clients: list[EngineClient], prompt_ids: list[int], *, max_new_tokens: int, temperature: float, seed: int = 0
) -> list[p.GenerateResponse]:
    """One seeded sample per engine, with its logprobs."""
    request = p.GenerateReqInput(
        input_ids=prompt_ids,
        return_logprob=True,
        sampling_params=p.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, sampling_seed=seed, ignore_eos=True
        ),
    )
    return [rows[0] for rows in await asyncio.gather(*(c.generate(request) for c in clients))]


def probe_batch(prompt_ids: list[int], responses: list[p.GenerateResponse]) -> TrainBatch:
    """The engines' samples as a learner batch (one row per engine, right-padded)."""
    rows = [prompt_ids + r.output_ids for r in responses]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(prompt_ids) : len(row)] = 1
    return TrainBatch(ids, mask)


def check_parity(
    clients: list[EngineClient],
    prompt_ids: list[int],
    responses: list[p.GenerateResponse],
    learner_logprobs: torch.Tensor,
    tolerance: float,
) -> dict[str, float]:
    """Max |engine − learner| logprob per engine; ParityError above the tolerance."""
    gaps: dict[str, float] = {}
    start = len(prompt_ids)
    for client, response, row in zip(clients, responses, learner_logprobs):
        logprobs = response.meta_info.output_token_logprobs
        assert logprobs is not None, "engine_samples asks for logprobs"
        engine = torch.tensor([lp for lp, _, _ in logprobs])
        gaps[client.base_url] = float((engine - row[start : start + len(engine)]).abs().max())
    worst = max(gaps, key=lambda url: gaps[url])
    if gaps[worst] > tolerance:
        raise ParityError(
            f"engine {worst} disagrees with the learner after the weight sync: max "
            f"|Δlogprob| = {gaps[worst]:.3g} > weight_sync.parity_tolerance = {tolerance}"
        )
    return gaps
