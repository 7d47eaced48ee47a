"""A weight sync as the learner's ranks run it. Every rank takes part in the export (TP/EP/PP
gathers are collective) and in the probe's forward; only the source rank (global rank 0)
talks to the engines, on the event loop it owns."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_rlvr.weight_sync.probe import check_parity, engine_samples, parity_gaps, probe_batch
from megatron_rlvr.weight_sync.syncer import EnginesLost, WeightSyncer

if TYPE_CHECKING:
    from megatron_rlvr.weight_sync.colocated import ColocatedSyncer

PROBE_TOKENS = [1, 5, 9, 13, 17, 21, 25, 29]  # a fixed prompt, folded into the model's vocabulary


def sync_weights(
    learner,
    version: int,
    *,
    syncer: WeightSyncer | ColocatedSyncer | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    probe_tokens: int = 8,
    restarted: list[int] | None = None,
) -> dict:
    """Pushes the learner's weights to the engines as `version`, then runs the parity probe
    when weight_sync.parity_tolerance is set. Collective over the learner's ranks; the source
    rank passes its syncer and event loop; restarted: the engines the run restarted since they
    last got weights. Returns metrics on the source rank, where a failed probe raises
    ParityError carrying them (the run saves the step before it stops)."""
    if syncer is None:
        for _ in learner.export_hf():
            pass
    else:
        assert loop is not None, "the source rank passes its event loop"
        try:
            report = loop.run_until_complete(syncer.sync(learner.export_hf(), version, restarted or []))
        except EnginesLost:
            if learner.cfg.weight_sync.parity_tolerance is not None:
                dist.broadcast_object_list([None], src=0)  # the other ranks wait for the probe
            raise
    tolerance = learner.cfg.weight_sync.parity_tolerance
    if tolerance is None:
        return {} if syncer is None else _report_metrics(report)
    box: list[Any] = [None]
    hf = learner.bridge.hf_config
    prompt = [t % hf.vocab_size for t in PROBE_TOKENS]
    # the engines' routing, replayed by the learner, when they capture it (see probe.py)
    routing = (hf.num_hidden_layers, hf.num_experts_per_tok, hf.num_experts)
    replayed = bool(learner.cfg.rollout.return_routed_experts)
    if syncer is not None:
        assert loop is not None
        responses = loop.run_until_complete(
            engine_samples(
                syncer.member_clients,
                prompt,
                max_new_tokens=probe_tokens,
                temperature=learner.cfg.rollout.temperature,
                routed=replayed,
            )
        )
        box = [(responses, probe_batch(prompt, responses, routing if replayed else None))]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:  # the source rank's sync lost its engines: it syncs again
        return {}
    responses, batch = box[0]
    logprobs = learner.compute_logprobs(batch, old_logprob_pass=False)
    if syncer is None:
        return {}
    gaps = parity_gaps(syncer.member_clients, prompt, responses, logprobs)
    return check_parity(gaps, tolerance, replayed=replayed, metrics=_report_metrics(report))


def _report_metrics(report) -> dict:
    return {
        "weight_sync/seconds": report.seconds,
        "weight_sync/bytes": report.bytes,
        "weight_sync/buckets": report.buckets,
        "weight_sync/version": report.version,
        "weight_sync/engine_version": report.engine_version,
    }
