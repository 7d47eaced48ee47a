"""The SGLang API as this project's client uses it, against the CPU engine and — in the opt-in
conformance tier (`pytest -m sglang`, after `bash scripts/setup_sglang_cpu.sh`) — against a
real SGLang 0.5.23 server on CPU. Same tests, same client: the two must be interchangeable."""

import asyncio
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from engine_fixtures import hf_teacher_forced, start_engine
from megatron_rlvr.config import WeightSyncConfig
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.launcher import ServerProcess
from megatron_rlvr.rollout.routed_experts import decode_routed_experts
from megatron_rlvr.weight_sync.syncer import WeightSyncer

REPO = Path(__file__).resolve().parents[1]


def start_sglang(model_dir, log_dir) -> ServerProcess:
    if not (REPO / ".venv-sglang" / "bin" / "python").exists():
        pytest.fail("the sglang tier needs a real SGLang: run `bash scripts/setup_sglang_cpu.sh` first")
    port = free_port()
    command = ["bash", str(REPO / "tests" / "sglang_cpu" / "launch.sh"), str(model_dir), str(port),
               "--enable-return-routed-experts", "--weight-version", "0"]
    return ServerProcess(command, "127.0.0.1", port, Path(log_dir) / "sglang.log").start(ready_timeout_s=300)


@pytest.fixture(scope="module", params=["cpu", pytest.param("sglang", marks=pytest.mark.sglang)])
def api_engine(request, tiny_hf_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"{request.param}-logs")
    server = start_engine(tiny_hf_dir, log_dir) if request.param == "cpu" else start_sglang(tiny_hf_dir, log_dir)
    server.kind = request.param
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
    rows = generate(api_engine, {"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
                                 "sampling_params": {"max_new_tokens": 12, "temperature": 0.7, "n": 2}})
    assert len(rows) == 4  # flat, grouped by prompt in order
    for row, prompt in zip(rows, [prompts[0]] * 2 + [prompts[1]] * 2):
        meta = row["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(row["output_ids"])
        assert [t for _, t, _ in meta["output_token_logprobs"]] == row["output_ids"]
        want_logp, want_routing = hf_teacher_forced(tiny_hf_dir, prompt, row["output_ids"], 0.7)
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        assert (got - want_logp).abs().max() <= 1e-5
        routing = decode_routed_experts(meta["routed_experts"], num_layers=2, top_k=2, num_experts=4,
                                        sample=meta["id"])
        assert np.array_equal(routing, want_routing.numpy())  # HF's router top-k, order included


def test_finish_reasons(api_engine):
    first = generate(api_engine, {"input_ids": [4, 4], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert first["meta_info"]["finish_reason"] == {**first["meta_info"]["finish_reason"], "type": "length", "length": 3}
    stop_on = first["output_ids"][1]
    row = generate(api_engine, {"input_ids": [4, 4], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "stop_token_ids": [stop_on]}})
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


def test_weight_sync_during_retract_tags_spans_and_changes_the_model(api_engine, tiny_hf_dir, tmp_path):
    """The real learner-side path: WeightSyncer pauses (retract), sends flattened buckets over
    a gloo group the engine joined, ends the session and resumes; the request in flight comes
    back with two weight-version spans, and the engine then computes with the new weights."""
    from safetensors.torch import load_file, save_file

    original = load_file(str(tiny_hf_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.2.down_proj.weight",
             "model.layers.1.mlp.gate.weight"]
    new = {n: original[n] + 0.3 * torch.randn(original[n].shape, generator=gen) for n in names}
    thread, box = _in_background(api_engine, {"input_ids": [2, 7, 1], "sampling_params": {}})

    async def sync(tensors, version):
        client = EngineClient(api_engine.url)
        syncer = WeightSyncer([client], WeightSyncConfig(bucket_mb=0.01, pause_mode="retract"),
                              initial_version=version - 1, checksums=api_engine.kind == "cpu")
        await syncer.connect()
        report = await syncer.sync(list(tensors.items()), version)
        await syncer.close()
        await client.close()
        return report

    current = int(httpx.get(f"{api_engine.url}/model_info").json()["weight_version"])
    report = asyncio.run(sync(new, current + 1))
    assert report.buckets >= 2
    thread.join(300)
    spans = box["r"][0]["meta_info"]["weight_versions"]
    assert spans[0]["version"] == str(current) and spans[-1]["version"] == str(current + 1)
    assert spans[-1]["end"] == 480
    assert httpx.get(f"{api_engine.url}/model_info").json()["weight_version"] == str(current + 1)
    updated = tmp_path / "updated"
    updated.mkdir()
    for f in ("config.json", "generation_config.json"):
        (updated / f).write_bytes((tiny_hf_dir / f).read_bytes())
    save_file({**original, **new}, str(updated / "model.safetensors"))
    row = generate(api_engine, {"input_ids": [8, 9, 10], "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 6}})
    logp, _ = hf_teacher_forced(updated, [8, 9, 10], row["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in row["meta_info"]["output_token_logprobs"]])
    assert (got - logp).abs().max() <= 1e-5
    assert asyncio.run(sync({n: original[n] for n in names}, current + 2)).tensors == 3  # restore


def test_unknown_field_is_a_4xx_and_the_server_goes_on(api_engine):
    response = httpx.post(f"{api_engine.url}/generate", json={"input_ids": [1], "sampling_params": {
        "max_new_tokens": 2, "temperatur": 1.0}}, timeout=30)
    assert 400 <= response.status_code < 500 and "temperatur" in response.text
    assert generate(api_engine, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})["output_ids"]
