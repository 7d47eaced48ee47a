"""The run's API key on a real CPU engine process: it reaches the server off its command line
and never shows in its log, its launcher's repr or environment fields; a request without it (a
weight update included) gets 401 and changes nothing, the same request with it is served;
/health needs no key (as in SGLang). SGLang's key file is gone on every path out of a start."""

import asyncio
import dataclasses
import secrets
import sys

import httpx
import pytest
import torch
from engine_fixtures import start_engine

from megatron_rlvr.config import CpuEngine, SglangEngine, WeightSyncConfig
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient, EngineRequestError
from megatron_rlvr.rollout.launcher import EngineStartError, engine_process
from megatron_rlvr.weight_sync.syncer import WeightSyncer

NAME = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def keyed(tiny_hf_dir, tmp_path_factory):
    key = secrets.token_urlsafe(32)
    server = start_engine(tiny_hf_dir, tmp_path_factory.mktemp("keyed"), routed=False, api_key=key)
    yield server, key
    server.stop()


def weight(url: str, key: str) -> torch.Tensor:
    got = httpx.post(
        f"{url}/get_weights_by_name",
        json={"name": NAME, "truncate_size": 64},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    return torch.tensor(got.json())


def test_a_keyed_engine_serves_only_requests_that_carry_the_key(keyed):
    server, key = keyed
    assert key not in " ".join(server.command)
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        assert key.encode() not in f.read()  # what `ps` shows
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": key}):
        refused = httpx.get(f"{server.url}/model_info", headers=headers, timeout=10)
        assert refused.status_code == 401 and "API key" in refused.json()["message"]
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{server.url}/generate", json=generate, timeout=30).status_code == 401
    served = httpx.post(f"{server.url}/generate", json=generate, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert served.status_code == 200 and len(served.json()["output_ids"]) == 2


def test_a_weight_update_without_the_key_is_refused_and_with_it_applied(keyed, tiny_hf_dir):
    from safetensors.torch import load_file

    server, key = keyed
    original = load_file(str(tiny_hf_dir / "model.safetensors"))[NAME]
    new = original + 1.0
    update = {"names": [NAME], "dtypes": ["float32"], "shapes": [list(new.shape)], "group_name": "auth_test"}
    for path, body in (("/begin_weight_update", {}), ("/update_weights_from_distributed", update)):
        assert httpx.post(f"{server.url}{path}", json=body, timeout=10).status_code == 401

    async def keyless():
        client = EngineClient(server.url)
        try:
            for call in (client.begin_weight_update(), client.update_weights_from_distributed(request)):
                with pytest.raises(EngineRequestError, match="API key"):
                    await call
        finally:
            await client.close()

    async def sync():
        client = EngineClient(server.url, api_key=key)
        syncer = WeightSyncer([client], WeightSyncConfig(bucket_mb=0.05), group_name="auth_test", checksums=True)
        try:
            await syncer.connect()
            return await syncer.sync([(NAME, new)], syncer.version + 1)
        finally:
            await syncer.close()
            await client.close()

    request = p.UpdateWeightsFromDistributedReqInput.model_validate(update)
    asyncio.run(keyless())
    assert torch.equal(weight(server.url, key), original)  # nothing changed
    report = asyncio.run(sync())
    assert report.engine_version == 1 and torch.equal(weight(server.url, key), new)
    assert key not in server.log_path.read_text()


def test_a_sync_to_an_engine_that_refuses_the_key_ends_at_once_naming_it(keyed):
    """A 401 is an answer, not silence: the syncer's survey of the engines stops with the
    engine's refusal instead of waiting out its bound for an engine to come back."""
    from megatron_rlvr.weight_sync.syncer import WeightSyncError

    server, key = keyed

    async def sync_with_the_wrong_key():
        client = EngineClient(server.url, api_key=key)
        syncer = WeightSyncer([client], WeightSyncConfig(bucket_mb=0.05), group_name="auth_wrong", checksums=True)
        stranger = EngineClient(server.url, api_key="not-the-key")  # as if the port now served another run
        try:
            await syncer.connect()
            syncer.clients = [stranger]
            return await syncer.sync([(NAME, torch.zeros(4))], syncer.version + 1)
        finally:
            syncer.clients = [client]
            await syncer.close()
            await client.close()
            await stranger.close()

    # the refusal itself, not the survey's "no engine is alive" after its 300 s bound
    with pytest.raises(WeightSyncError, match=f"an engine refused.*{server.url}.*401.*API key"):
        asyncio.run(sync_with_the_wrong_key())


def keyed_processes(tmp_path, key: str):
    """A keyed CPU engine and a keyed SGLang engine as the launcher makes them (not started)."""
    common = dict(host="127.0.0.1", routed_experts=True, log_dir=tmp_path, api_key=key)
    sglang = SglangEngine(device="cpu", python=sys.executable, dtype="float32")
    return [
        engine_process("/m", CpuEngine(), port=free_port(), **common),
        engine_process("/m", sglang, port=free_port(), name="engine 1 (sglang)", **common),
    ]


def test_the_key_is_in_no_repr_argv_or_environment_field(tmp_path):
    key = secrets.token_urlsafe(32)
    cpu, sglang = keyed_processes(tmp_path, key)
    for proc in (cpu, sglang):
        assert key not in repr(proc) and key not in str(proc)
        assert key not in " ".join(proc.command)
        assert key not in repr(proc.env)
    assert cpu.key_env is not None and sglang.key_file is not None  # how each gets it at start instead


@pytest.mark.parametrize("how", ["popen raises", "server exits"])
def test_the_key_file_is_gone_whatever_ends_a_start(tmp_path, how):
    key = secrets.token_urlsafe(32)
    sglang = keyed_processes(tmp_path, key)[1]
    if how == "popen raises":
        proc = dataclasses.replace(sglang, command=[str(tmp_path / "no-such-python"), *sglang.command[1:]])
        expected: type[BaseException] = FileNotFoundError
    else:
        proc = dataclasses.replace(sglang, command=[sys.executable, "-c", "import sys; sys.exit(3)"])
        expected = EngineStartError
    with pytest.raises(expected):
        proc.start(ready_timeout_s=30)
    assert proc.key_file is not None and not proc.key_file.exists()
    assert all(key not in path.read_text() for path in tmp_path.iterdir())
