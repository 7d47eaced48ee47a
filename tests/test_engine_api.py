"""The SGLang API as this project's client uses it, against the CPU engine and against a real
SGLang 0.5.23 server on CPU, started by the project's own launcher (rollout.engine of type
sglang, device cpu, from .venv-sglang). Same tests, same client: the two must be
interchangeable. The sglang half needs `bash scripts/setup_sglang_cpu.sh` (the README's test
command runs it); `pytest -m sglang` selects it alone."""

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from engine_fixtures import hf_teacher_forced, start_engine, start_sglang, start_sglang_cuda

from megatron_rlvr.config import WeightSyncConfig
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.routed_experts import decode_routed_experts
from megatron_rlvr.weight_sync.syncer import WeightSyncer

STARTERS = {"cpu": start_engine, "sglang": start_sglang, "sglang_cuda": start_sglang_cuda}


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param("sglang", marks=pytest.mark.sglang),
        pytest.param("sglang_cuda", marks=pytest.mark.gpu),
    ],
)
def api_engine(request, tiny_hf_dir, tmp_path_factory):
    """The CPU engine, SGLang on CPU, and (scripts/gpu_check.sh) SGLang on a GPU in float32."""
    log_dir = tmp_path_factory.mktemp(f"{request.param}-logs")
    server = STARTERS[request.param](tiny_hf_dir, log_dir)
    server.kind = request.param
    server.tolerance = 1e-3 if request.param == "sglang_cuda" else 1e-5  # |Δlogprob| vs HF fp32 on CPU
    yield server
    if server.alive:  # a paused SGLang waits for its requests on SIGTERM: resume first
        httpx.post(f"{server.url}/continue_generation", json={}, timeout=10)
    server.stop()


def generate(engine, body, timeout=120):
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def test_batch_with_n_samples_logprobs_and_routed_experts_match_hf(api_engine, tiny_hf_dir):
    prompts = [[5, 17, 3, 44, 9], [70, 2]]
    rows = generate(
        api_engine,
        {
            "input_ids": prompts,
            "return_logprob": True,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.7, "n": 2},
        },
    )
    assert len(rows) == 4  # flat, grouped by prompt in order
    for row, prompt in zip(rows, [prompts[0]] * 2 + [prompts[1]] * 2):
        meta = row["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(row["output_ids"])
        assert [t for _, t, _ in meta["output_token_logprobs"]] == row["output_ids"]
        want_logp, want_routing = hf_teacher_forced(tiny_hf_dir, prompt, row["output_ids"], 0.7)
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        assert (got - want_logp).abs().max() <= api_engine.tolerance
        routing = decode_routed_experts(meta["routed_experts"], num_layers=2, top_k=2, num_experts=4, sample=meta["id"])
        assert np.array_equal(routing, want_routing.numpy())  # HF's router top-k, order included


def test_finish_reasons(api_engine):
    first = generate(api_engine, {"input_ids": [4, 4], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert first["meta_info"]["finish_reason"] == {**first["meta_info"]["finish_reason"], "type": "length", "length": 3}
    stop_on = first["output_ids"][1]
    row = generate(
        api_engine,
        {"input_ids": [4, 4], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": [stop_on]}},
    )
    assert row["meta_info"]["finish_reason"]["type"] == "stop"
    assert row["meta_info"]["finish_reason"]["matched"] == stop_on and row["output_ids"][-1] == stop_on


def _in_background(engine, body):
    """A long request (8 samples × 480 tokens) that is surely still running a moment later."""
    box = {}
    body["sampling_params"].update(n=8, max_new_tokens=480, ignore_eos=True)
    thread = threading.Thread(target=lambda: box.update(r=generate(engine, body, timeout=300)))
    thread.start()
    time.sleep(0.5)
    return thread, box


def test_abort_mid_generation(api_engine):
    thread, box = _in_background(api_engine, {"input_ids": [3, 1, 4], "rid": "conf-abort", "sampling_params": {}})
    assert httpx.post(f"{api_engine.url}/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
    thread.join(120)
    for row in box["r"]:
        meta = row["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 480
    assert generate(api_engine, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})["output_ids"]


async def push_weights(engine, tensors: dict, version: int, **sync_cfg):
    """The learner side of one sync (WeightSyncer over gloo) with `tensors` as `version`."""
    client = EngineClient(engine.url)
    syncer = WeightSyncer(
        [client],
        WeightSyncConfig(bucket_mb=0.01, **sync_cfg),
        initial_version=version - 1,
        checksums=engine.kind == "cpu",
    )
    try:
        await syncer.connect()
        return await syncer.sync(list(tensors.items()), version)
    finally:
        await syncer.close()
        await client.close()


def updated_model_dir(tiny_hf_dir, tmp_path, new: dict):
    """An HF checkpoint of the tiny model with `new` tensors swapped in: HF's reference."""
    from safetensors.torch import load_file, save_file

    updated = tmp_path / "updated"
    updated.mkdir()
    for f in ("config.json", "generation_config.json"):
        (updated / f).write_bytes((tiny_hf_dir / f).read_bytes())
    save_file({**load_file(str(tiny_hf_dir / "model.safetensors")), **new}, str(updated / "model.safetensors"))
    return updated


def test_weight_sync_during_retract_tags_spans_and_changes_the_model(api_engine, tiny_hf_dir, tmp_path):
    """The real learner-side path: WeightSyncer pauses (retract), sends flattened buckets over
    a gloo group the engine joined, ends the session and resumes; the request in flight comes
    back with two weight-version spans, and the engine then computes with the new weights."""
    from safetensors.torch import load_file

    original = load_file(str(tiny_hf_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.2.down_proj.weight",
        "model.layers.1.mlp.gate.weight",
    ]
    new = {n: original[n] + 0.3 * torch.randn(original[n].shape, generator=gen) for n in names}
    thread, box = _in_background(api_engine, {"input_ids": [2, 7, 1], "sampling_params": {}})

    sync = lambda tensors, version: push_weights(api_engine, tensors, version)  # noqa: E731
    current = int(httpx.get(f"{api_engine.url}/model_info").json()["weight_version"])
    report = asyncio.run(sync(new, current + 1))
    assert report.buckets >= 2
    thread.join(300)
    spans = box["r"][0]["meta_info"]["weight_versions"]
    assert spans[0]["version"] == str(current) and spans[-1]["version"] == str(current + 1)
    assert spans[-1]["end"] == 480
    assert httpx.get(f"{api_engine.url}/model_info").json()["weight_version"] == str(current + 1)
    updated = updated_model_dir(tiny_hf_dir, tmp_path, new)
    row = generate(
        api_engine, {"input_ids": [8, 9, 10], "return_logprob": True, "sampling_params": {"max_new_tokens": 6}}
    )
    logp, _ = hf_teacher_forced(updated, [8, 9, 10], row["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in row["meta_info"]["output_token_logprobs"]])
    assert (got - logp).abs().max() <= api_engine.tolerance
    assert asyncio.run(sync({n: original[n] for n in names}, current + 2)).tensors == 3  # restore


def test_unknown_field_is_a_4xx_and_the_server_goes_on(api_engine):
    response = httpx.post(
        f"{api_engine.url}/generate",
        json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "temperatur": 1.0}},
        timeout=30,
    )
    assert 400 <= response.status_code < 500 and "temperatur" in response.text
    assert generate(api_engine, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})["output_ids"]


def test_a_repeated_prompt_after_a_sync_is_computed_with_the_new_weights(api_engine, tiny_hf_dir, tmp_path):
    """No KV (or routed experts) computed under the old weights survives a sync: the prefix
    cache is flushed, so a prompt seen before the sync is recomputed in full, and its
    logprobs and routing are HF's under the new weights. Without a sync, SGLang's radix cache
    serves the repeat (the CPU engine has no prefix cache)."""
    from safetensors.torch import load_file

    prompt = [11, 23, 5, 67, 8, 19, 42, 3, 77, 61, 9, 14]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
    }
    generate(api_engine, body)
    again = generate(api_engine, body)["meta_info"]
    assert again["cached_tokens"] > 0 if api_engine.kind != "cpu" else again["cached_tokens"] == 0
    original = load_file(str(tiny_hf_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    new = {
        n: t + 0.5 * torch.randn(t.shape, generator=gen) for n, t in original.items() if n.startswith("model.layers.0.")
    }  # attention, router and experts of layer 0
    current = int(httpx.get(f"{api_engine.url}/model_info").json()["weight_version"])
    asyncio.run(push_weights(api_engine, new, current + 1))
    row = generate(api_engine, body)
    meta = row["meta_info"]
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == str(current + 1)
    logp, routing = hf_teacher_forced(updated_model_dir(tiny_hf_dir, tmp_path, new), prompt, row["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert (got - logp).abs().max() <= max(api_engine.tolerance, 1e-4)
    routed = decode_routed_experts(meta["routed_experts"], num_layers=2, top_k=2, num_experts=4, sample=meta["id"])
    assert np.array_equal(routed, routing.numpy())  # every prompt position routed under the new weights
    asyncio.run(push_weights(api_engine, {n: original[n] for n in new}, current + 2))  # restore


def hf_continued(old_dir, new_dir, prompt: list[int], output: list[int], switch: int, temperature: float):
    """Logprobs of output[switch:] and the router top-k of the positions fed from
    len(prompt) + switch - 1 on, from HF's new weights continuing from the old weights' KV
    cache of everything fed before (what an in-place pause computes after the sync)."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(str(old_dir), dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(str(new_dir), dtype=torch.float32)
    with torch.no_grad():
        cache = old(torch.tensor([prompt + output[: switch - 1]]), use_cache=True).past_key_values
        rest = new(
            torch.tensor([output[switch - 1 : -1]]), past_key_values=cache, use_cache=True, output_router_logits=True
        )
    logp = torch.log_softmax(rest.logits[0] / temperature, -1).gather(-1, torch.tensor(output[switch:])[:, None])
    k = new.config.num_experts_per_tok
    routing = torch.stack([torch.softmax(lg.float(), -1).topk(k, -1).indices for lg in rest.router_logits], dim=1)
    return logp.squeeze(-1), routing


@pytest.mark.slow  # when the sync lands depends on the machine's load (10 to 215 tokens seen), and
# the default tier covers the CPU engine's side in process (test_continuous_batching.py)
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_routed_experts_of_a_sequence_a_sync_lands_in(api_engine, tiny_hf_dir, tmp_path, mode):
    """What R3 replays for a sequence a weight sync lands in (rollout.updates = in_flight):
    the engine's routed_experts, decoded as the rollout manager does. SGLang stores a
    position's routing with its KV slot and reads it when the request finishes.

    In place (KV kept: the pause R3 in flight needs) every position keeps the routing it was
    fed with: the tokens sampled by the old weights come back with the old weights' routing,
    the later ones with the new weights' over the old KV, each the same weights as its
    logprob. SGLang's overlap scheduler has one forward in flight at the pause, computed by
    the old weights; its token is counted in the new version's weight_versions span (the
    span is one token late), while its logprob and routing are the old weights' as they
    should be. Retracted, the sequence is re-prefilled into new slots and every position comes
    back routed by the new weights, while the earlier tokens' logprobs stay the old weights':
    why the config refuses retract with R3 in flight."""
    from safetensors.torch import load_file

    original = load_file(str(tiny_hf_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(13)
    new = {n: t + 0.5 * torch.randn(t.shape, generator=gen) for n, t in original.items() if ".layers." in n}
    updated = updated_model_dir(tiny_hf_dir, tmp_path, new)
    prompt = [31, 4, 59, 26, 53, 58, 1, 93]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 480, "temperature": 1.0, "ignore_eos": True},
    }
    box = {}
    thread = threading.Thread(target=lambda: box.update(r=generate(api_engine, body, timeout=300)))
    thread.start()
    time.sleep(0.5)
    current = int(httpx.get(f"{api_engine.url}/model_info").json()["weight_version"])
    try:
        asyncio.run(push_weights(api_engine, new, current + 1, pause_mode=mode))
        thread.join(300)
    finally:  # the old weights back, and (retract flushes) no KV of the new ones left cached
        asyncio.run(push_weights(api_engine, {n: original[n] for n in new}, current + 2))
    meta = box["r"]["meta_info"]
    out = box["r"]["output_ids"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [str(current), str(current + 1)], spans  # the sync landed mid-way
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    old_logp, old_routing = hf_teacher_forced(tiny_hf_dir, prompt, out, 1.0)
    new_logp, new_routing = hf_teacher_forced(updated, prompt, out, 1.0)
    late = 1 if mode == "in_place" and api_engine.kind != "cpu" else 0  # SGLang's overlap scheduler
    switch = spans[1]["start"] + late  # the first token the new weights computed (checked below)
    # fp32 KV-cached decoding vs HF's full forward drifts to ~1e-5 over a few hundred tokens
    assert (got[:switch] - old_logp[:switch]).abs().max() <= max(api_engine.tolerance, 5e-5)
    before = len(prompt) + switch - 1  # positions fed (and routed) by the old weights
    routed = decode_routed_experts(meta["routed_experts"], num_layers=2, top_k=2, num_experts=4, sample=mode)
    assert len(routed) == len(prompt) + len(out) - 1
    assert not np.array_equal(old_routing[:before].numpy(), new_routing[:before].numpy())  # the sync moved them
    if mode == "in_place":
        assert np.array_equal(routed[:before], old_routing[:before].numpy())  # the routing that produced them
        logp, routing = hf_continued(tiny_hf_dir, updated, prompt, out, switch, 1.0)
        assert np.array_equal(routed[before:], routing.numpy())
        assert (got[switch:] - logp).abs().max() <= max(api_engine.tolerance, 1e-4)
    else:
        assert np.array_equal(routed, new_routing.numpy())  # routed again at the re-prefill
        assert (got[switch:] - new_logp[switch:]).abs().max() <= max(api_engine.tolerance, 1e-4)
