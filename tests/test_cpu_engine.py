"""CPU-engine behaviour beyond the shared API tests (tests/test_engine_api.py): seeded
sampling, every pause mode, request validation, weight-update rules, the async client."""

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from engine_fixtures import hf_teacher_forced, start_engine

from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient, EngineRequestError
from megatron_rlvr.weight_sync.buckets import bucket_checksum
from megatron_rlvr.weight_sync.transport import broadcast, open_group


@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory):
    proc = start_engine(tiny_hf_dir, tmp_path_factory.mktemp("engine-logs"))
    yield proc
    proc.stop()


def post(engine, path, body=None, timeout=60):
    return httpx.post(f"{engine.url}{path}", json=body, timeout=timeout)


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax(engine, tiny_hf_dir):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 5}}
    assert post(engine, "/generate", body).json()["output_ids"] == post(engine, "/generate", body).json()["output_ids"]
    greedy = post(
        engine,
        "/generate",
        {"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    ).json()
    logp, _ = hf_teacher_forced(tiny_hf_dir, [1, 2, 3], greedy["output_ids"], 0.0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3] + greedy["output_ids"]])).logits[0, 2:-1]
    assert logits.argmax(-1).tolist() == greedy["output_ids"]


def _long_request(engine, rid, results):
    body = {"input_ids": [3, 1, 4], "rid": rid, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    results[rid] = post(engine, "/generate", body, timeout=120).json()


def _start_long(engine, rid):
    results = {}
    thread = threading.Thread(target=_long_request, args=(engine, rid, results))
    thread.start()
    time.sleep(0.4)
    return thread, results


def test_pause_retract_then_continue_tags_tokens_with_their_weight_version(engine):
    thread, results = _start_long(engine, "long-2")
    assert post(engine, "/pause_generation", {"mode": "retract"}).json()["success"]
    assert post(engine, "/flush_cache").status_code == 200  # retracted: no KV held
    post(engine, "/update_weight_version", {"new_version": "7"})
    assert post(engine, "/continue_generation", {}).json()["success"]
    thread.join(120)
    meta = results["long-2"]["meta_info"]
    assert meta["completion_tokens"] == 480 and meta["finish_reason"]["type"] == "length"
    spans = meta["weight_versions"]
    assert spans[0]["version"] != "7" and spans[-1]["version"] == "7" and spans[-1]["end"] == 480
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
    assert meta["weight_version"] == "7"


def test_pause_in_place_holds_requests_until_continue(engine):
    thread, results = _start_long(engine, "long-3")
    post(engine, "/pause_generation", {"mode": "in_place"})
    time.sleep(0.5)
    assert "long-3" not in results
    assert post(engine, "/flush_cache").status_code == 400  # in-place requests keep their KV
    post(engine, "/continue_generation", {})
    thread.join(120)
    assert results["long-3"]["meta_info"]["completion_tokens"] == 480


def test_pause_abort_ends_running_requests(engine):
    thread, results = _start_long(engine, "long-4")
    post(engine, "/pause_generation", {"mode": "abort"})
    thread.join(60)
    assert results["long-4"]["meta_info"]["finish_reason"]["type"] == "abort"
    post(engine, "/continue_generation", {})


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [1], "sampling_params": {"temperatur": 1.0}}, "sampling_params.temperatur: unknown field"),
        ({"input_ids": [1], "max_tokens": 3}, "max_tokens: unknown field"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}, "sampling_params.max_new_tokens"),
        (
            {"input_ids": list(range(90)) * 6, "sampling_params": {"max_new_tokens": 8}},
            "longer than the model's context length",
        ),
        ({"input_ids": [1, 999]}, "outside the vocabulary"),
        ({"input_ids": []}, "input_ids is empty"),
        ({"text": "hello"}, "no tokenizer"),
        ({}, "exactly one of text and input_ids"),
    ],
)
def test_malformed_requests_get_a_4xx_naming_the_problem(engine, body, message):
    response = post(engine, "/generate", body)
    assert 400 <= response.status_code < 500
    assert message in response.json()["message"]


def test_bad_json_and_healthy_after(engine):
    response = httpx.post(f"{engine.url}/generate", content=b"{not json", timeout=10)
    assert response.status_code == 400 and "not valid JSON" in response.json()["message"]
    assert httpx.get(f"{engine.url}/health").status_code == 200
    assert httpx.get(f"{engine.url}/model_info").json()["architectures"] == ["Qwen3MoeForCausalLM"]


def _next_version(engine) -> str:
    return str(int(httpx.get(f"{engine.url}/model_info").json()["weight_version"]) + 1)


def _update(engine, names, tensors, *, flattened: bool, checksum_ok: bool = True, version=None):
    """Plays the learner's part: rank 0 of a fresh update group, one broadcast per bucket."""
    version = version or _next_version(engine)
    port = free_port()
    group_box = {}
    sender = threading.Thread(target=lambda: group_box.update(g=open_group("127.0.0.1", port, 0, 2, "wg", "gloo")))
    sender.start()
    joined = post(
        engine,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "wg",
            "backend": "gloo",
        },
    )
    sender.join(30)
    assert joined.status_code == 200, joined.text
    group = group_box["g"]
    assert post(engine, "/begin_weight_update", {}).status_code == 200
    buffer = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
    body = {
        "names": names,
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "group_name": "wg",
        "weight_version": version,
        "load_format": "flattened_bucket" if flattened else None,
    }
    if flattened:
        body["checksum"] = bucket_checksum(buffer) if checksum_ok else "0" * 64
    reply = {}
    request = threading.Thread(
        target=lambda: reply.update(
            r=post(engine, "/update_weights_from_distributed", {k: v for k, v in body.items() if v is not None})
        )
    )
    request.start()
    if flattened:
        broadcast(group, buffer)
    else:
        for tensor in tensors:
            broadcast(group, tensor.contiguous())
    request.join(60)
    post(engine, "/end_weight_update", {})
    post(engine, "/destroy_weights_update_group", {"group_name": "wg"})
    return reply["r"]


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened-bucket", "per-tensor"])
def test_weight_update_over_a_real_gloo_group(engine, tiny_hf_dir, tmp_path, flattened):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tiny_hf_dir / "model.safetensors"))
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.0.mlp.gate.weight",
    ]
    gen = torch.Generator().manual_seed(3 if flattened else 4)
    new = [weights[n] + 0.3 * torch.randn(weights[n].shape, generator=gen) for n in names]
    version = _next_version(engine)
    reply = _update(engine, names, new, flattened=flattened, version=version)
    assert reply.status_code == 200, reply.text
    assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == version
    # the engine now computes exactly what HF computes with the new weights
    updated = tmp_path / "updated"
    updated.mkdir()
    for f in ("config.json", "generation_config.json"):
        (updated / f).write_bytes((tiny_hf_dir / f).read_bytes())
    save_file({**weights, **dict(zip(names, new))}, str(updated / "model.safetensors"))
    row = post(
        engine,
        "/generate",
        {"input_ids": [8, 9, 10], "return_logprob": True, "sampling_params": {"max_new_tokens": 6, "sampling_seed": 2}},
    ).json()
    logp, _ = hf_teacher_forced(updated, [8, 9, 10], row["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in row["meta_info"]["output_token_logprobs"]])
    assert (got - logp).abs().max() <= 1e-5
    assert row["meta_info"]["weight_version"] == version
    # put the original weights back for the other tests
    assert _update(engine, names, [weights[n] for n in names], flattened=True).status_code == 200


def test_weight_update_rules(engine, tiny_hf_dir):
    from safetensors.torch import load_file

    weights = load_file(str(tiny_hf_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    before = httpx.get(f"{engine.url}/model_info").json()["weight_version"]
    bad = _update(engine, [name], [weights[name] * 2], flattened=True, checksum_ok=False)
    assert bad.status_code == 400 and "checksum mismatch" in bad.json()["message"]
    assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == before  # kept, and why:
    older = str(int(before) - 1)
    stale = _update(engine, [name], [weights[name]], flattened=True, version=older)
    assert stale.status_code == 400 and f"stale weight version {older}" in stale.json()["message"]
    outside = post(
        engine,
        "/update_weights_from_distributed",
        {"names": [name], "dtypes": ["float32"], "shapes": [[64, 64]], "group_name": "wg"},
    )
    assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]
    assert _update(engine, [name], [weights[name]], flattened=True).status_code == 200
    got = post(engine, "/get_weights_by_name", {"name": name, "truncate_size": 64}).json()
    assert torch.equal(torch.tensor(got), weights[name])


def test_async_client_speaks_the_api(engine):
    async def run():
        client = EngineClient(engine.url)
        rows = await client.generate(
            p.GenerateReqInput(
                input_ids=[[1, 2], [3]], return_logprob=True, sampling_params=p.SamplingParams(max_new_tokens=3)
            )
        )
        assert len(rows) == 2 and all(len(r.meta_info.output_token_logprobs) == 3 for r in rows)
        single = await client.generate(
            p.GenerateReqInput(input_ids=[5], sampling_params=p.SamplingParams(max_new_tokens=2))
        )
        assert len(single) == 1
        with pytest.raises(EngineRequestError, match="outside the vocabulary"):
            await client.generate(p.GenerateReqInput(input_ids=[500]))
        assert await client.health() and client.healthy
        await client.close()

    asyncio.run(run())


# ----------------------------------------------------------------------------- MoE families
ENGINE_FAMILIES = ["qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "moonlight", "kimi_k2"]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_routed_experts_equal_hf_routing_and_every_checkpoint_tensor_is_addressable(family, family_dir):
    """Each family's router (softmax; sigmoid with score bias; group-limited) is captured as
    HF routes, dense layers as zeros; the weight table holds every checkpoint tensor under its
    checkpoint name (Mixtral's block_sparse_moe…w1, the expert score bias) as the model's own."""
    from safetensors.torch import load_file
    from tiny_families import hf_forward_with_routing, hf_model

    from megatron_rlvr.rollout.cpu_engine import CpuEngine

    model_dir = family_dir(family)
    engine = CpuEngine(str(model_dir))
    try:
        prompt = [5, 17, 3, 42, 8]
        (seq,) = engine.submit(prompt, p.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), None)
        seq = seq.future.result(timeout=120)
    finally:
        engine.stop()
    fed = torch.tensor([prompt + seq.output_ids[:-1]])
    _, routing = hf_forward_with_routing(hf_model(model_dir), fed)
    ours = torch.tensor(np.stack(seq.routing)).long()
    assert ours.shape == routing[0].shape
    assert torch.equal(ours.sort(-1).values, routing[0].sort(-1).values)
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    assert set(engine.weights) == set(checkpoint)
    assert all(torch.equal(engine.weights[name], tensor) for name, tensor in checkpoint.items())


def test_gpt_oss_routed_experts_come_from_its_router_and_match_hf(tiny_gpt_oss_dir, tmp_path):
    """gpt-oss routes in `mlp.router` (not `mlp.gate`): the engine captures it, with HF's
    logprobs, and its weight table holds the fused expert tensors under their own names."""
    import numpy as np

    from megatron_rlvr.rollout.routed_experts import decode_routed_experts

    proc = start_engine(tiny_gpt_oss_dir, tmp_path)
    try:
        prompt = [5, 17, 3, 44, 9, 21, 60]  # longer than the sliding window (4)
        row = post(
            proc,
            "/generate",
            {
                "input_ids": prompt,
                "return_logprob": True,
                "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0.7},
            },
        ).json()
        meta = row["meta_info"]
        want_logp, want_routing = hf_teacher_forced(tiny_gpt_oss_dir, prompt, row["output_ids"], 0.7)
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        assert (got - want_logp).abs().max() <= 1e-5
        routing = decode_routed_experts(meta["routed_experts"], num_layers=2, top_k=2, num_experts=4, sample=meta["id"])
        assert np.array_equal(routing, want_routing.numpy())
        fused = post(proc, "/get_weights_by_name", {"name": "model.layers.1.mlp.experts.gate_up_proj"}).json()
        assert torch.tensor(fused).shape == (4, 64, 64)
    finally:
        proc.stop()
