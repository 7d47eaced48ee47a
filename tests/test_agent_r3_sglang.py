"""What real SGLang 0.5.23 on CPU returns as `meta_info.routed_experts` for an episode's history
(turn k+1's input is turn k's input and output and a tool turn), and the R3 rule built on it
(megatron_rlvr/agent/routing.py): the episode's routing is the last turn's. One server for the
module (tiny random Qwen3-MoE, 2 layers, 4 experts, top-2, fp32), weights moved between turns by
the project's WeightSyncer. A version of SGLang that changes any of this fails here.

Run as a script, this file is the learner rank of the three-turn test (tests/distributed.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from distributed import run_ranks
from engine_fixtures import hf_teacher_forced, start_sglang
from safetensors.torch import load_file
from test_engine_api import updated_model_dir

from megatron_rlvr.agent.routing import episode_routing
from megatron_rlvr.algo.advantages import AdvantageOptions
from megatron_rlvr.batching import groups_to_batch
from megatron_rlvr.config import PARITY_TOLERANCE, WeightSyncConfig, load_config
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.routed_experts import RoutedExpertsError, decode_routed_experts
from megatron_rlvr.samples import Group, Sample
from megatron_rlvr.weight_sync.syncer import WeightSyncer

TOOL_TURN = [7, 8, 9, 10]  # the tokens a tool turn appends (the template's, tokenized once)
PROMPT = [5, 17, 3, 44, 9, 21, 30, 2]
LAYERS, TOP_K, EXPERTS = 2, 2, 4

pytestmark = pytest.mark.sglang


# ----------------------------------------------------------------------------- the engine side
@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory):
    server = start_sglang(tiny_hf_dir, tmp_path_factory.mktemp("sglang"))  # routed experts on
    try:
        yield server
    finally:
        server.stop()


def turn(url: str, ids: list[int], seed: int, n: int = 6):
    """One turn: (output ids, their logprobs, routing [positions, layers, k], meta_info)."""

    async def ask():
        client = EngineClient(url)
        try:
            request = p.GenerateReqInput(
                input_ids=ids,
                return_logprob=True,
                return_routed_experts=True,
                sampling_params=p.SamplingParams(
                    max_new_tokens=n, temperature=1.0, sampling_seed=seed, ignore_eos=True
                ),
            )
            return (await client.generate(request))[0]
        finally:
            await client.close()

    reply = asyncio.run(ask())
    meta = reply.meta_info
    assert meta.routed_experts is not None and meta.output_token_logprobs is not None
    routing = decode_routed_experts(
        meta.routed_experts, num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, sample="t"
    )
    return reply.output_ids, [lp for lp, _, _ in meta.output_token_logprobs], routing, meta


def sync(url: str, model_dir: Path, shift_seed: int | None, pause_mode: str) -> dict:
    """The project's sync of the tiny model's weights moved by 0.5·N(0, 1) (None: unmoved) as
    the engine's next version; returns the tensors sent. retract/abort flush the prefix cache
    at the end of the sync, in_place does not (the config allows it only without a cache)."""
    original = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(shift_seed or 0)
    moved = {
        n: t + (0.0 if shift_seed is None else 0.5) * torch.randn(t.shape, generator=gen) for n, t in original.items()
    }
    version = int(httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"])

    async def push():
        client = EngineClient(url)
        syncer = WeightSyncer(
            [client], WeightSyncConfig(bucket_mb=0.05, pause_mode=pause_mode), group_name=f"v{version + 1}"
        )
        try:
            await syncer.connect()
            syncer.version = version
            await syncer.sync(list(moved.items()), version + 1)
        finally:
            await syncer.close()
            await client.close()

    asyncio.run(push())
    return moved


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of position·layer rows with the same top-k in the same order."""
    return float((np.asarray(a) == np.asarray(b)).all(-1).mean())


def two_turns(url: str, seed: int, between=lambda: None):
    first_out, first_lp, first_routing, first_meta = turn(url, PROMPT, seed)
    between()
    second_in = PROMPT + first_out + TOOL_TURN
    second_out, second_lp, second_routing, second_meta = turn(url, second_in, seed + 1)
    return {
        "first": (first_out, first_lp, first_routing, first_meta),
        "second_in": second_in,
        "second": (second_out, second_lp, second_routing, second_meta),
        "history": len(PROMPT) + len(first_out) - 1,  # positions the first turn returned
    }


def test_a_cache_hit_returns_the_earlier_turns_routing_for_the_history(engine, tiny_hf_dir):
    """(a) The radix cache holds turn 1 but its last sampled token (never fed): turn 2 reuses
    those KV slots and reads the routing turn 1 wrote into them."""
    sync(engine.url, tiny_hf_dir, None, "retract")
    ep = two_turns(engine.url, seed=1)
    first_routing, second_routing, meta = ep["first"][2], ep["second"][2], ep["second"][3]
    h = ep["history"]
    assert meta.cached_tokens == h and meta.prompt_tokens == len(ep["second_in"])
    assert second_routing.shape[0] == len(ep["second_in"]) + len(ep["second"][0]) - 1
    assert np.array_equal(second_routing[:h], first_routing)


def test_a_cache_miss_under_the_same_weights_routes_the_history_again_identically(engine):
    """(b) A flush between the turns: turn 2 computes the history again, with the same weights,
    and its routing equals turn 1's (fp32 on CPU: no near-tie flips on this model)."""
    ep = two_turns(engine.url, seed=2, between=lambda: httpx.post(f"{engine.url}/flush_cache", timeout=60))
    assert ep["second"][3].cached_tokens == 0
    assert np.array_equal(ep["second"][2][: ep["history"]], ep["first"][2])


def test_a_sync_without_a_flush_reuses_old_kv_and_mixes_versions(engine, tiny_hf_dir, tmp_path):
    """(c) in_place pause (no flush): turn 2, tagged with the new version alone, reuses the old
    weights' KV and routing for the history, so its logprobs are neither version's. This is
    what the config refuses (in_place needs --disable-radix-cache) and why every other sync
    flushes."""
    sync(engine.url, tiny_hf_dir, None, "retract")
    box: dict = {}
    ep = two_turns(
        engine.url, seed=3, between=lambda: box.setdefault("new", sync(engine.url, tiny_hf_dir, 11, "in_place"))
    )
    second_out, second_lp, second_routing, meta = ep["second"]
    h = ep["history"]
    assert meta.cached_tokens == h  # KV of the old version reused
    assert int(meta.weight_version) == int(ep["first"][3].weight_version) + 1
    assert np.array_equal(second_routing[:h], ep["first"][2])
    new_dir = updated_model_dir(tiny_hf_dir, tmp_path, box["new"])
    old_lp, old_routing = hf_teacher_forced(tiny_hf_dir, ep["second_in"], second_out, 1.0)
    new_lp, new_routing = hf_teacher_forced(new_dir, ep["second_in"], second_out, 1.0)
    assert agreement(second_routing[:h], old_routing[:h]) == 1.0 > agreement(second_routing[:h], new_routing[:h])
    engine_lp = torch.tensor(second_lp)
    assert (engine_lp - new_lp).abs().max() > 0.1 and (engine_lp - old_lp).abs().max() > 0.1  # neither


def test_a_sync_that_flushes_routes_the_history_again_under_the_new_weights(engine, tiny_hf_dir, tmp_path):
    """(c) The project's sync (retract pause, flush at the end): turn 2 misses the cache and
    computes the whole sequence under the new weights: its routing for every position and its
    logprobs are the new weights', and turn 1's tokens keep the old weights' logprobs. The last
    turn's routing reproduces the last turn's logprobs; no routing reproduces both turns'."""
    sync(engine.url, tiny_hf_dir, None, "retract")
    box: dict = {}
    ep = two_turns(
        engine.url, seed=4, between=lambda: box.setdefault("new", sync(engine.url, tiny_hf_dir, 12, "retract"))
    )
    first_out, first_lp, first_routing, first_meta = ep["first"]
    second_out, second_lp, second_routing, meta = ep["second"]
    assert meta.cached_tokens == 0
    new_dir = updated_model_dir(tiny_hf_dir, tmp_path, box["new"])
    new_lp, new_routing = hf_teacher_forced(new_dir, ep["second_in"], second_out, 1.0)
    assert agreement(second_routing, new_routing.numpy()) == 1.0
    assert (torch.tensor(second_lp) - new_lp).abs().max() <= 1e-4
    old_lp, old_routing = hf_teacher_forced(tiny_hf_dir, PROMPT, first_out, 1.0)
    assert agreement(first_routing, old_routing.numpy()) == 1.0
    assert (torch.tensor(first_lp) - old_lp).abs().max() <= 1e-4
    first_under_new, _ = hf_teacher_forced(new_dir, PROMPT, first_out, 1.0)
    assert (torch.tensor(first_lp) - first_under_new).abs().max() > 0.1
    assert agreement(second_routing[: ep["history"]], first_routing) < 1.0  # the history routed again
    assert episode_routing(second_routing, len(ep["second_in"]) + len(second_out), "c") is second_routing


def test_cache_salt_keeps_prefixes_apart(engine):
    """SGLang 0.5.23's `cache_salt` (SkyRL's per-version salt): the same ids under another salt
    miss the cache, under the same salt hit it. The project flushes at every sync instead."""
    ids = [*PROMPT, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "ignore_eos": True}}
    cached = []
    for salt in ("s1", "s1", "s2"):
        reply = httpx.post(f"{engine.url}/generate", json={**body, "cache_salt": salt}, timeout=120).json()
        cached.append(reply["meta_info"]["cached_tokens"])
    assert cached[1] == len(ids) - 1 and cached[2] == 0


def test_a_last_turn_routing_that_does_not_cover_the_episode_is_one_line_naming_the_sample():
    """Without an engine: rows short of (or beyond) the episode's positions are refused."""
    for rows in (22, 24):
        with pytest.raises(RoutedExpertsError) as err:
            episode_routing(np.zeros((rows, LAYERS, TOP_K), dtype=np.uint8), 24, "g/0")
        message = str(err.value)
        assert message.startswith(f"sample g/0: the last turn's routed_experts has {rows} rows, the episode fed 23")
        assert "\n" not in message


# ----------------------------------------------------------------------------- must-show
def test_a_three_turn_episode_with_a_sync_between_turns_1_and_2_is_replayed_exactly(engine, tiny_hf_dir, tmp_path):
    """Three turns, a retract-mode sync (flush) between turns 1 and 2. Each turn's input is an
    exact prefix of the next; the loss mask is 1 exactly on sampled tokens; the version changes
    at the turn boundary; the episode's routing (the last turn's) covers every position; the
    Megatron CPU learner replaying it (agreement 1.0) gives turns 2 and 3's logprobs within the
    parity tolerance under the new weights, and turn 1's, with turn 1's own routing, under the
    old weights."""
    sync(engine.url, tiny_hf_dir, None, "retract")
    inputs, replies, moved = [PROMPT], [], None
    for number in range(3):
        if number == 1:
            moved = sync(engine.url, tiny_hf_dir, 21, "retract")
        out, lp, routing, meta = turn(engine.url, inputs[-1], seed=30 + number)
        replies.append((out, lp, routing, meta))
        if number < 2:
            inputs.append(inputs[-1] + out + TOOL_TURN)
    for before, after in zip(inputs, inputs[1:]):
        assert after[: len(before)] == before
    final = inputs[-1] + replies[-1][0]
    routing = episode_routing(replies[-1][2], len(final), "episode")  # covers every position but the last
    assert agreement(routing[: len(PROMPT) + len(replies[0][0]) - 1], replies[0][2]) < 1.0  # the sync re-routed
    spans = [  # each turn's version spans moved to its place in the response, as agent/episode.py does
        {**span, "start": span["start"] + len(ids) - len(PROMPT), "end": span["end"] + len(ids) - len(PROMPT)}
        for ids, (_, _, _, meta) in zip(inputs, replies)
        for span in meta.weight_versions or []
    ]
    response = final[len(PROMPT) :]
    loss_mask = [0] * len(response)
    logprobs = [0.0] * len(response)
    for ids, (out, lp, _, _) in zip(inputs, replies):
        start = len(ids) - len(PROMPT)
        loss_mask[start : start + len(out)] = [1] * len(out)
        logprobs[start : start + len(out)] = lp
    assert sum(loss_mask) == sum(len(r[0]) for r in replies) and all(
        loss_mask[len(ids) - len(PROMPT) - len(TOOL_TURN) + i] == 0 for ids in inputs[1:] for i in range(len(TOOL_TURN))
    )
    sample = Sample(
        prompt_id="p",
        group_id="g",
        index=0,
        prompt_ids=PROMPT,
        response_ids=response,
        rollout_logprobs=logprobs,
        finish_reason="length",
        weight_version=replies[-1][3].weight_version,
        weight_versions=spans,
        routed_experts=routing,
        reward=1.0,
        loss_mask=loss_mask,
    )
    versions = sample.token_versions()
    first_end = len(replies[0][0])
    v0 = int(replies[0][3].weight_version)
    assert set(versions[:first_end]) == {v0} and {
        versions[i] for i, m in enumerate(loss_mask) if m and i >= first_end
    } == {v0 + 1}
    batch = groups_to_batch([Group("p", "g", [sample])], advantage=AdvantageOptions(), routing=(LAYERS, TOP_K))
    turn_one = replace(
        sample,
        response_ids=replies[0][0],
        rollout_logprobs=replies[0][1],
        weight_versions=[],
        routed_experts=replies[0][2],
        loss_mask=None,
    )  # turn 1 alone, with its own routing
    first = groups_to_batch([Group("p", "g", [turn_one])], advantage=AdvantageOptions(), routing=(LAYERS, TOP_K))
    torch.save({"episode": batch, "first": first}, tmp_path / "batches.pt")
    new_dir = updated_model_dir(tiny_hf_dir, tmp_path, moved)
    (result,) = run_ranks(
        1,
        [str(tmp_path / "batches.pt"), str(tiny_hf_dir), str(new_dir)],
        tmp_path,
        worker=Path(__file__),
    )
    learner = torch.tensor(result["episode"])
    engine_lp = torch.tensor(logprobs)
    sampled = torch.tensor(loss_mask, dtype=torch.bool)
    later = sampled.clone()
    later[:first_end] = False
    tolerance = PARITY_TOLERANCE["float32"]
    assert (learner[len(PROMPT) :][later] - engine_lp[later]).abs().max() <= tolerance
    assert (learner[len(PROMPT) :][:first_end] - engine_lp[:first_end]).abs().max() > 0.1  # stale: old weights'
    first_learner = torch.tensor(result["first"])[len(PROMPT) :]
    assert (first_learner - torch.tensor(replies[0][1])).abs().max() <= tolerance
    assert result["agreement"]["episode"] == result["agreement"]["first"] == 1.0


# ----------------------------------------------------------------------------- the learner rank
def _learner_rank() -> None:
    """learner rank: BATCHES OLD_HF_DIR NEW_HF_DIR → the episode's logprobs under the new
    weights and the first turn's under the old, each with its routing replayed (R3)."""
    from megatron_rlvr.learner.learner import Learner  # Megatron-Core: in the rank only
    from megatron_rlvr.learner.parallel import destroy_parallel, init_parallel

    path, old_dir, new_dir = sys.argv[1:]
    batches = torch.load(path, weights_only=False)
    overrides = [
        "algo.routing_replay=r3",
        "algo.num_minibatches=1",
        "trainer.micro_batch_size=1",
        "rollout.temperature=1.0",
    ]
    cfg = load_config(None, overrides)
    init_parallel(cfg.parallel, seed=cfg.trainer.seed)
    result: dict = {"agreement": {}}
    for name, model_dir in (("episode", new_dir), ("first", old_dir)):
        learner = Learner(load_config(None, overrides), model_dir)
        result[name] = learner.compute_logprobs(batches[name])[0].tolist()
        result["agreement"][name] = learner._engine_agreement["routing_agreement_engine_used"]
        learner.close()
    with open(os.environ["RESULT"], "w") as f:
        json.dump(result, f)
    destroy_parallel()


if __name__ == "__main__":
    _learner_rank()
