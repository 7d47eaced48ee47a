"""The engine side of colocation on the CPU engine (rollout/memory_api.py) and the learner's
hand-over sender (weight_sync/tensor_handover.py), against real engine processes on loopback:
memory really released and taken back (RSS of the engine process), generation and updates
refused while released, release refused while a request runs, the CPU backup, payloads that
are refused in one line, and every parameter of each family handed over bitwise."""

import asyncio
import base64
import contextlib
import io
import pickle
import threading
import time
import types

import httpx
import pytest
import torch
from engine_fixtures import hf_teacher_forced, start_engine
from tiny_families import FAMILIES, hf_model

from megatron_rlvr.config import TinyModel
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.cpu_engine import CpuEngine, EngineError, expert_weight_table
from megatron_rlvr.rollout.memory_api import MemoryOccupation
from megatron_rlvr.rollout.server import create_app
from megatron_rlvr.tiny_model import build_tiny_hf_model
from megatron_rlvr.weight_sync.tensor_handover import hand_over, serialize

PROMPT = [5, 17, 3, 44, 9]


@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory):
    proc = start_engine(tiny_hf_dir, tmp_path_factory.mktemp("engine-logs"))
    yield proc
    proc.stop()


def post(engine, path, body=None, timeout=60):
    return httpx.post(f"{engine.url}{path}", json=body, timeout=timeout)


def engine_weight(engine, name: str, http=httpx) -> torch.Tensor:
    """A weight as the engine holds it, whole (float32 round-trips JSON exactly)."""
    response = http.post(f"{engine.url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, timeout=60)
    assert response.status_code == 200, response.text
    return torch.tensor(response.json(), dtype=torch.float32)


def run(coro):
    return asyncio.run(coro)


async def _hand_over(url: str, named: dict[str, torch.Tensor], version: str, bucket_bytes: int = 20_000):
    client = EngineClient(url, update_timeout_s=60)
    try:
        return await hand_over(
            [(client, 1)], list(named.items()), bucket_bytes=bucket_bytes, weight_version=version, settle_s=0.1
        )
    finally:
        await client.close()


def test_released_engine_refuses_generate_and_updates_and_its_weights_come_back_as_zeros_until_pushed(
    engine, tiny_hf_dir
):
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 6}}
    assert post(engine, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}).status_code == 200
    refused = post(engine, "/generate", body)
    assert refused.status_code == 400
    message = refused.json()["message"]
    assert "\n" not in message and "memory released (kv_cache, weights)" in message
    assert "/resume_memory_occupation" in message
    post(engine, "/begin_weight_update", {})
    update = {"serialized_named_tensors": ["x"], "load_format": "flattened_bucket"}
    assert "weights are released" in post(engine, "/update_weights_from_tensor", update).json()["message"]
    post(engine, "/end_weight_update", {})
    assert "already released: weights" in post(engine, "/release_memory_occupation", {"tags": ["weights"]}).text
    assert "weights are released" in post(engine, "/get_weights_by_name", {"name": "lm_head.weight"}).text

    assert post(engine, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert post(engine, "/generate", body).status_code == 400  # the KV cache is still released
    assert post(engine, "/resume_memory_occupation", {}).status_code == 200  # all that is released
    assert "not released" in post(engine, "/resume_memory_occupation", {"tags": ["kv_cache"]}).text
    assert not engine_weight(engine, "model.layers.0.mlp.experts.1.down_proj.weight").any()  # no CPU backup

    original = expert_weight_table(hf_model(tiny_hf_dir))
    stats = run(_hand_over(engine.url, original, "1"))
    assert stats.tensors == len(original) and stats.buckets > 1
    assert stats.bytes == sum(t.numel() * t.element_size() for t in original.values())
    for name, tensor in original.items():
        assert torch.equal(engine_weight(engine, name).view(torch.int32), tensor.view(torch.int32)), name
    row = post(engine, "/generate", body).json()
    assert row["meta_info"]["weight_version"] == "1"
    want, _ = hf_teacher_forced(tiny_hf_dir, PROMPT, row["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in row["meta_info"]["output_token_logprobs"]])
    assert (got - want).abs().max() <= 1e-5


def test_release_is_refused_while_a_request_runs(engine):
    results = {}
    body = {"input_ids": [3, 1, 4], "rid": "long", "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: results.update(row=post(engine, "/generate", body, timeout=120).json()))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while post(engine, "/flush_cache").status_code == 200:  # 400 once the request holds a KV cache
            assert time.monotonic() < deadline, "the long request never started running"
            time.sleep(0.02)
        refused = post(engine, "/release_memory_occupation", {})
        assert refused.status_code == 400
        assert "refused: 1 requests are queued or running" in refused.json()["message"]
    finally:
        post(engine, "/abort_request", {"rid": "long"})
        thread.join(120)
    assert results["row"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(engine, "/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}).status_code == 200  # idle
    assert post(engine, "/resume_memory_occupation", {}).status_code == 200


def test_requests_retracted_by_a_pause_wait_through_a_release_and_finish_after_resume(engine):
    """As SGLang: a paused engine may release with retracted requests waiting (they hold no
    KV cache); they are not admitted until the memory is resumed and generation continued."""
    results = {}
    body = {"input_ids": [3, 1, 4], "rid": "kept", "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: results.update(row=post(engine, "/generate", body, timeout=180).json()))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while post(engine, "/flush_cache").status_code == 200:
            assert time.monotonic() < deadline, "the long request never started running"
            time.sleep(0.02)
        assert post(engine, "/pause_generation", {"mode": "retract"}).status_code == 200
        assert post(engine, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
        assert post(engine, "/continue_generation", {}).status_code == 200
        assert post(engine, "/flush_cache").status_code == 200  # not admitted: no KV cache held
        assert "row" not in results
        assert post(engine, "/resume_memory_occupation", {}).status_code == 200
    finally:
        thread.join(180)
    assert results["row"]["meta_info"]["completion_tokens"] == 480


def test_the_cpu_backup_brings_the_weights_back_intact(tiny_hf_dir):
    engine = CpuEngine(str(tiny_hf_dir))
    try:
        before = {name: tensor.clone() for name, tensor in engine.weights.items()}
        memory = MemoryOccupation(engine, weights_cpu_backup=True)
        assert memory.release(None) == ["cuda_graph", "kv_cache", "weights"]
        assert engine.weights == {}
        assert all(t.numel() == 0 for t in engine.model.parameters())
        with pytest.raises(EngineError, match="generation refused"):
            engine.submit([1, 2], p.SamplingParams(max_new_tokens=2), None)
        memory.resume(None)
        assert set(engine.weights) == set(before)
        assert all(torch.equal(engine.weights[name], tensor) for name, tensor in before.items())
    finally:
        engine.stop()


def _payload(obj) -> str:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


class _Runs:
    def __reduce__(self):
        return (print, ("a payload ran code",))


@pytest.mark.parametrize(
    "update, message",
    [
        ({"serialized_named_tensors": [_payload(_Runs())]}, "builtins.print is not allowed in a payload"),
        ({"serialized_named_tensors": ["not base64!"]}, "not a tensor payload"),
        ({"serialized_named_tensors": ["", ""]}, "has 2 entries: one per TP rank, and this engine has 1"),
        ({"serialized_named_tensors": [_payload([("a", 1)])]}, "load_format None carries a list of (name, tensor)"),
        (
            {"serialized_named_tensors": [_payload({"flattened_tensor": 1})], "load_format": "flattened_bucket"},
            "flattened_tensor must be a 1-D uint8 tensor",
        ),
        ({"serialized_named_tensors": [""], "load_format": "safetensors"}, "load_format 'safetensors'"),
    ],
)
def test_a_bad_payload_is_refused_in_one_line_and_fails_the_session(engine, update, message):
    post(engine, "/begin_weight_update", {})
    refused = post(engine, "/update_weights_from_tensor", update)
    assert refused.status_code == 400 and message in refused.json()["message"]
    assert "\n" not in refused.json()["message"]
    assert "weight update failed" in post(engine, "/end_weight_update", {}).json()["message"]
    assert post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_a_file_descriptor_payload_is_refused_naming_the_sharing_strategy(engine):
    """torch's default CPU sharing passes a descriptor only the sender's children can fetch."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as torch_mp

    assert torch_mp.get_sharing_strategy() == "file_descriptor"
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("lm_head.weight", torch.zeros(96, 64))])
    post(engine, "/begin_weight_update", {})
    refused = post(
        engine,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [base64.b64encode(buffer.getvalue()).decode()]},
    )
    post(engine, "/end_weight_update", {})
    assert "torch's file_system sharing strategy" in refused.json()["message"]
    serialize([("x", torch.zeros(2))])
    assert torch_mp.get_sharing_strategy() == "file_descriptor"  # the sender puts it back


def test_client_calls_are_bounded_and_name_what_they_waited_for():
    """An engine that accepts the connection and never answers: each call gives up."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        async def calls():
            client = EngineClient(url)
            try:
                for call in (
                    client.release_memory_occupation(["weights"], timeout_s=0.5),
                    client.resume_memory_occupation(timeout_s=0.5),
                ):
                    with pytest.raises(ConnectionError, match=r"waited up to 0.5 s for .*_memory_occupation"):
                        await call
            finally:
                await client.close()

        run(calls())


def test_a_bucket_outlives_the_replies_until_the_settle_bound():
    """SGLang answers before its device copy ends: a sent bucket must not be freed (so not
    reused) at the reply, only once settle_s has passed after it."""
    import weakref

    from megatron_rlvr.weight_sync.buckets import pack
    from megatron_rlvr.weight_sync.tensor_handover import _Held

    def sent():
        bucket = pack([("w", torch.ones(4))])
        return bucket, weakref.ref(bucket.buffer)

    held = _Held(settle_s=3600.0)
    bucket, first = sent()
    held.keep(bucket)
    bucket, second = sent()
    held.keep(bucket)
    del bucket
    assert first() is not None and second() is not None  # replied, but the bound has not passed
    held.free_due(time.monotonic() + 3599.0)
    assert first() is not None and second() is not None
    held.free_due(time.monotonic() + 3601.0)
    assert first() is None and second() is None


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_the_engine_rss_falls_by_its_weights_and_kv_cache_on_release_and_comes_back_on_resume(tmp_path):
    """A 0.3 GB model, so the weights stand far out of the process's noise. The KV cache of the
    batch just served is freed with it (the CPU engine's KV cache lives per batch)."""
    spec = TinyModel(
        hidden_size=512,
        moe_intermediate_size=512,
        num_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=24,
        num_experts_per_tok=2,
    )
    model_dir = build_tiny_hf_model(spec, tmp_path / "model", vocab_size=4096)
    proc = start_engine(model_dir, tmp_path / "logs", routed=False)
    try:
        pid = proc.proc.pid
        weights = sum(t.numel() * t.element_size() for t in expert_weight_table(hf_model(model_dir)).values())
        assert weights > 300 * 2**20
        rows, tokens = 8, 64
        batch = {"input_ids": [PROMPT] * rows, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        assert post(proc, "/generate", batch, timeout=300).status_code == 200
        kv_cache = 2 * spec.num_layers * spec.num_key_value_heads * spec.head_dim * 4 * rows * (len(PROMPT) + tokens)
        served = _rss(pid)
        assert post(proc, "/release_memory_occupation", {}).status_code == 200
        released = _rss(pid)
        assert post(proc, "/resume_memory_occupation", {}).status_code == 200
        resumed = _rss(pid)
    finally:
        proc.stop()
    mib = {
        k: round(v / 2**20) for k, v in dict(served=served, released=released, resumed=resumed, weights=weights).items()
    }
    print(f"engine RSS MiB: {mib}")  # docs/colocation.md quotes this line (pytest -rP)
    assert served - released >= weights + kv_cache, (served, released, weights, kv_cache)
    assert resumed - released >= weights, (resumed, released, weights)


# ----------------------------------------------------------------------------- every family
@contextlib.contextmanager
def served_here(model_dir):
    """The CPU engine's app on loopback from a thread of this process: a real HTTP server,
    without a process start per family (the payload's cross-process path is the module
    engine's and the RSS test's)."""
    import uvicorn

    engine = CpuEngine(str(model_dir))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process engine server did not start"
        time.sleep(0.01)
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", *FAMILIES])
def test_every_parameter_of_each_family_is_handed_over_bitwise(family, family_dir, tiny_hf_dir, tiny_gpt_oss_dir):
    model_dir = {"qwen3_moe": tiny_hf_dir, "gpt_oss": tiny_gpt_oss_dir}.get(family) or family_dir(family)
    table = expert_weight_table(hf_model(model_dir))
    gen = torch.Generator().manual_seed(7)
    new = {name: torch.randn(t.shape, generator=gen).to(t.dtype) for name, t in table.items()}
    with served_here(model_dir) as server:
        stats = run(_hand_over(server.url, new, "1", bucket_bytes=1 << 16))
        assert stats.tensors == len(new) and stats.buckets > 1
        with httpx.Client() as http:
            for name, tensor in new.items():
                assert torch.equal(engine_weight(server, name, http).view(torch.int32), tensor.view(torch.int32)), name
            assert http.get(f"{server.url}/model_info").json()["weight_version"] == "1"
