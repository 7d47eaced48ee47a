"""The parity probe after each sync: a fixed prompt's logprobs from every engine against the
learner's for the same tokens. A sync that silently broke the weights (a wrong transpose, a
missing expert, the "gibberish after the first sync" bug) shows up here as a large
difference, and the run stops naming the engine and the size of the gap.

What it compares must be free of MoE routing flips, or a deep model fails it on noise: where
two experts' scores nearly tie, bf16 rounding on one side picks the other expert, and that
token's logprob moves by tenths of a nat, more often the more MoE layers a token crosses
(48 in Qwen3-30B-A3B). So when the engines capture their routing (rollout.return_routed_experts,
on under R3) the probe asks for it and the learner replays it: the gap left is the numeric
one, judged by its max. Without it the gap is judged by its median over the probe's tokens:
a flip moves a few tokens, a broken sync every one."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch

from megatron_rlvr.errors import UserError
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.routed_experts import decode_routed_experts, pack_routed_experts


class ParityError(UserError):
    """An engine's logprobs disagree with the learner's after a sync. metrics: the step's sync
    metrics (the run logs them and saves the step before it stops)."""

    def __init__(self, message: str, metrics: Mapping[str, float] | None = None):
        super().__init__(message)
        self.metrics = dict(metrics or {})

    def __reduce__(self):  # crosses Ray with its metrics
        return (type(self), (str(self), self.metrics))


async def engine_samples(
    clients: list[EngineClient],
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    routed: bool = False,
) -> list[p.GenerateResponse]:
    """One seeded sample per engine, with its logprobs (and its routing when `routed`)."""
    request = p.GenerateReqInput(
        input_ids=prompt_ids,
        return_logprob=True,
        return_routed_experts=routed,
        sampling_params=p.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, sampling_seed=seed, ignore_eos=True
        ),
    )
    return [rows[0] for rows in await asyncio.gather(*(c.generate(request) for c in clients))]


def probe_batch(
    prompt_ids: list[int], responses: list[p.GenerateResponse], routing: tuple[int, int, int] | None = None
) -> TrainBatch:
    """The engines' samples as a learner batch (one row per engine, right-padded); routing:
    (layers, top_k, experts) to carry each engine's routed experts for the learner to replay."""
    rows = [prompt_ids + r.output_ids for r in responses]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(prompt_ids) : len(row)] = 1
    batch = TrainBatch(ids, mask)
    if routing is not None:
        layers, top_k, experts = routing
        names = [f"parity-probe/{i}" for i in range(len(rows))]
        decoded = []
        for name, response in zip(names, responses):
            if response.meta_info.routed_experts is None:
                raise ParityError(f"{name}: the engine returned no routed_experts for the parity probe")
            decoded.append(
                decode_routed_experts(
                    response.meta_info.routed_experts, num_layers=layers, top_k=top_k, num_experts=experts, sample=name
                )
            )
        lengths = [len(row) for row in rows]
        batch.routed_experts = pack_routed_experts(
            decoded, lengths, width, num_layers=layers, top_k=top_k, sample_ids=names
        )
    return batch


def parity_gaps(
    clients: list[EngineClient], prompt_ids: list[int], responses: list[p.GenerateResponse], learner: torch.Tensor
) -> dict[str, torch.Tensor]:
    """|engine − learner| logprob of every probe token, per engine."""
    start = len(prompt_ids)
    gaps = {}
    for client, response, row in zip(clients, responses, learner):
        logprobs = response.meta_info.output_token_logprobs
        assert logprobs is not None, "engine_samples asks for logprobs"
        engine = torch.tensor([lp for lp, _, _ in logprobs])
        gaps[client.base_url] = (engine - row[start : start + len(engine)]).abs()
    return gaps


def check_parity(
    gaps: dict[str, torch.Tensor], tolerance: float, *, replayed: bool, metrics: Mapping[str, float]
) -> dict[str, float]:
    """The probe's metrics; ParityError (carrying them) when an engine's judged gap (max with
    the engine's routing replayed, else median) is above the tolerance."""
    judged = {url: float(g.max() if replayed else g.median()) for url, g in gaps.items()}
    out = {
        **metrics,
        "weight_sync/parity_max_gap": max(float(g.max()) for g in gaps.values()),
        "weight_sync/parity_routing_replayed": float(replayed),
        "weight_sync/parity_tolerance": tolerance,
    }
    worst = max(judged, key=lambda url: judged[url])
    if judged[worst] > tolerance:
        statistic = "max" if replayed else "median"
        routing = "the engine's, replayed" if replayed else "the learner's own (the engines capture none)"
        raise ParityError(
            f"engine {worst} disagrees with the learner after the weight sync: {statistic} |Δlogprob| over "
            f"{len(gaps[worst])} probe tokens = {judged[worst]:.3g} > weight_sync.parity_tolerance = {tolerance} "
            f"(routing: {routing}). A gap of nats means the sync broke the weights (the family's export); "
            "if it is precision, raise weight_sync.parity_tolerance (null: probe off) and continue with "
            "trainer.resume=true",
            out,
        )
    return out
