"""Real SGLang 0.5.23 on CPU (.venv-sglang) and the colocated hand-over: update_weights_from_tensor
carries the learner's weights as flattened buckets in file-named shared memory and the parity
probe passes after it; release/resume_memory_occupation answer 200 and free nothing (the memory
saver is CUDA-only, off here), so generation goes on with the weights intact."""

import asyncio

import pytest
import torch
from engine_fixtures import hf_teacher_forced, start_sglang
from safetensors.torch import load_file
from test_engine_api import updated_model_dir

from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.weight_sync.probe import check_parity, engine_samples, parity_gaps
from megatron_rlvr.weight_sync.tensor_handover import hand_over

pytestmark = pytest.mark.sglang

PROMPT = [5, 17, 3, 44, 9]


async def _probe(client: EngineClient, model_dir) -> dict[str, float]:
    """The parity probe against HF's logprobs for `model_dir` (the learner's weights)."""
    (response,) = await engine_samples([client], PROMPT, max_new_tokens=8, temperature=1.0, seed=3)
    logp, _ = hf_teacher_forced(model_dir, PROMPT, response.output_ids, 1.0)
    learner = torch.cat([torch.zeros(len(PROMPT)), logp])[None]
    return check_parity(parity_gaps([client], PROMPT, [response], learner), 1e-4, replayed=False, metrics={})


def test_sglang_cpu_takes_the_tensor_hand_over_and_its_memory_endpoints_free_nothing(tiny_hf_dir, tmp_path):
    server = start_sglang(tiny_hf_dir, tmp_path, routed=False)
    original = load_file(str(tiny_hf_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    new = {n: t + 0.3 * torch.randn(t.shape, generator=gen) for n, t in original.items()}

    async def steps():
        client = EngineClient(server.url, update_timeout_s=120)
        try:
            await client.release_memory_occupation()  # 200: the no-op adapter pauses nothing
            assert (await _probe(client, tiny_hf_dir))["weight_sync/parity_max_gap"] <= 1e-4  # served, intact
            await client.resume_memory_occupation()
            stats = await hand_over(
                [(client, 1)], list(new.items()), bucket_bytes=50_000, weight_version="1", settle_s=0.1
            )
            assert stats.buckets > 1 and stats.tensors == len(new)
            assert (await client.model_info())["weight_version"] == "1"
            return await _probe(client, updated_model_dir(tiny_hf_dir, tmp_path, new))
        finally:
            await client.close()

    try:
        metrics = asyncio.run(steps())
    finally:
        server.stop()
    assert metrics["weight_sync/parity_max_gap"] <= 1e-4
