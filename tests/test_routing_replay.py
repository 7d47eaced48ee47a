"""Routing replay: the routed-experts codec, token-layout mapping, and R2/R3 in real learner
processes (Megatron-Core's RouterReplay under our per-micro-batch driver)."""

import base64

import numpy as np
import pytest
import torch
from distributed import run_ranks

from megatron_rlvr.learner.routing_replay import local_token_order, replay_valid_mask
from megatron_rlvr.rollout.routed_experts import (
    RoutedExpertsError,
    compact_dtype,
    decode_routed_experts,
    encode_routed_experts,
    pack_routed_experts,
)


# ----------------------------------------------------------------------------- codec
def test_sglang_encoding_round_trips_into_compact_storage():
    experts = np.random.default_rng(0).integers(0, 128, size=(9, 4, 8))
    encoded = encode_routed_experts(experts)
    assert len(base64.b64decode(encoded)) == experts.size * 4  # int32 on the wire
    decoded = decode_routed_experts(encoded, num_layers=4, top_k=8, num_experts=128, sample="s0")
    assert decoded.dtype == np.uint8 and decoded.nbytes == experts.size  # 1 byte per id
    assert np.array_equal(decoded, experts)
    assert compact_dtype(256) == np.uint8 and compact_dtype(257) == np.int16


@pytest.mark.parametrize(
    "encoded, kwargs, message",
    [
        ("not base64!!", {}, "sample p7: routed_experts is not valid base64"),
        (encode_routed_experts(np.zeros((5, 3, 2))), {}, "not a multiple of layers × top_k = 4 × 2"),
        (encode_routed_experts(np.full((5, 4, 2), 9)), {}, "outside the model's 8 experts"),
    ],
)
def test_decode_errors_name_the_sample(encoded, kwargs, message):
    with pytest.raises(RoutedExpertsError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        decode_routed_experts(encoded, num_layers=4, top_k=2, num_experts=8, sample="p7", **kwargs)
    assert "sample p7" in str(err.value)


def test_pack_aligns_positions_and_checks_token_counts():
    a = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)  # sample of 3 tokens
    b = np.ones((4, 3, 2), dtype=np.uint8)  # sample of 5 tokens
    packed = pack_routed_experts([a, b], [3, 5], 6, num_layers=3, top_k=2, sample_ids=["a", "b"])
    assert packed.shape == (2, 6, 3, 2)
    assert torch.equal(packed[0, :2], torch.from_numpy(a)) and torch.equal(
        packed[1, :4], torch.ones(4, 3, 2, dtype=torch.uint8)
    )
    assert torch.equal(packed[0, 2:], torch.tensor([0, 1], dtype=torch.uint8).expand(4, 3, 2))  # filler
    with pytest.raises(
        RoutedExpertsError, match="sample b: routed_experts covers 4 positions, the sample has 6 tokens"
    ):
        pack_routed_experts([a, b], [3, 6], 6, num_layers=3, top_k=2, sample_ids=["a", "b"])
    with pytest.raises(
        RoutedExpertsError,
        match=r"sample a: routed_experts shaped \(2, 3, 2\), the model needs \[positions, 4 layers, top-2\]",
    ):
        pack_routed_experts([a], [3], 6, num_layers=4, top_k=2, sample_ids=["a"])


def test_local_token_order_is_sequence_major_and_split_for_sequence_parallel():
    per_position = torch.arange(2 * 4).view(2, 4)  # [b=2, s=4]: value = b*4 + s
    full = local_token_order(per_position, 0, 1, False)
    assert full.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # (s, b) order, as the router sees tokens
    assert local_token_order(per_position, 1, 2, True).tolist() == [2, 6, 3, 7]  # second SP chunk


def test_valid_mask_excludes_the_last_token_and_padding():
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    assert replay_valid_mask(mask).tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, True, False],
    ]


# ----------------------------------------------------------------------------- in the learner
def _run(tmp_path, world, scenario, hf_dir, *overrides):
    return run_ranks(world, [scenario, str(hf_dir), *overrides], tmp_path)


# World 1 on either device. On CUDA (scripts/gpu_check.py step "replay") every collective runs
# on NCCL and the model is the transformer-engine spec: replay is as exact as on the CPU, and
# logprobs differ from HF's (fp32, on the CPU) by TE's GEMMs only, which may use TF32, as in
# tests/test_learner.py's learner-hf test.
DEVICES = [pytest.param([], id="cpu"), pytest.param(["parallel.device=cuda"], marks=pytest.mark.gpu, id="cuda")]


@pytest.mark.parametrize("device", DEVICES)
def test_r2_replays_recorded_routing_exactly_even_when_routers_moved(device, tiny_hf_dir, tmp_path):
    result = _run(tmp_path, 1, "replay-r2", tiny_hf_dir, "algo.routing_replay=r2", *device)[0]
    assert result["checked"] > 0 and result["mismatched"] == 0
    assert result["metrics"]["routing_agreement_used"] == 1.0  # the layers dispatched with the recorded routing
    # perturbed routers would route most tokens elsewhere; replay held the recorded routing
    assert result["metrics"]["routing_agreement"] < 0.6
    assert {"routing_agreement/layer0", "routing_agreement/layer1"} <= set(result["metrics"])
    assert result["router_weights_moved"]  # replayed routing still trains the router


def test_r2_under_activation_recompute_matches_plain_backward(tiny_hf_dir, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "recompute").mkdir()
    plain = _run(tmp_path / "plain", 1, "replay-r2", tiny_hf_dir, "algo.routing_replay=r2")
    recompute = _run(
        tmp_path / "recompute",
        1,
        "replay-r2",
        tiny_hf_dir,
        "algo.routing_replay=r2",
        "trainer.recompute_activations=true",
    )
    assert recompute[0]["mismatched"] == 0 and recompute[0]["checked"] == plain[0]["checked"]
    for key in ("policy_loss", "grad_norm"):
        assert recompute[0]["metrics"][key] == pytest.approx(plain[0]["metrics"][key], rel=1e-9)


def test_r2_with_pipeline_and_recompute_equals_world1(tiny_hf_dir, tmp_path):
    """1F1B interleaves micro-batches: recomputation in backward must replay each micro-batch's
    own routing (Megatron's REPLAY_BACKWARD FIFO), or the gradients would differ."""
    (tmp_path / "w1").mkdir()
    (tmp_path / "pp2").mkdir()
    world1 = _run(tmp_path / "w1", 1, "replay-r2", tiny_hf_dir, "algo.routing_replay=r2")[0]
    for r in _run(
        tmp_path / "pp2",
        2,
        "replay-r2",
        tiny_hf_dir,
        "algo.routing_replay=r2",
        "parallel.pp=2",
        "trainer.recompute_activations=true",
    ):
        assert r["checked"] > 0 and r["mismatched"] == 0
        for key in ("policy_loss", "grad_norm", "routing_agreement"):
            assert r["metrics"][key] == pytest.approx(world1["metrics"][key], rel=1e-5)


R3_LAYOUTS = {
    "world1": (1, []),
    "ep2": (2, ["parallel.ep=2"]),
    "tp2-sp": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "cuda": (1, ["parallel.device=cuda"]),
}


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.gpu if name == "cuda" else ()) for name in R3_LAYOUTS]
)
def test_r3_reproduces_hf_routing_and_logprobs(layout, tiny_hf_dir, tmp_path):
    world, overrides = R3_LAYOUTS[layout]
    # on CUDA, TE's GEMMs round differently from HF's on the CPU: logprobs as in the learner-hf
    # test, and a near-tie among the router's scores may go the other way in the natural routing
    logprob_tolerance, agreement_tolerance = (1e-2, 0.05) if layout == "cuda" else (1e-5, 0.01)
    for r in _run(tmp_path, world, "replay-r3", tiny_hf_dir, "algo.routing_replay=r3", *overrides):
        assert r["checked"] > 0 and r["mismatched"] == 0
        assert r["metrics"]["routing_agreement_engine_used"] == 1.0  # dispatched with HF's routing
        assert r["logprob_max_diff_vs_hf"] <= logprob_tolerance, r["logprob_max_diff_vs_hf"]
        assert r["metrics"]["routing_agreement_engine"] == pytest.approx(1.0, abs=agreement_tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_r3_holds_engine_routing_when_the_learner_would_route_differently(device, tiny_hf_dir, tmp_path):
    r = _run(tmp_path, 1, "replay-r3-perturbed", tiny_hf_dir, "algo.routing_replay=r3", *device)[0]
    assert r["mismatched"] == 0
    assert r["metrics"]["routing_agreement_engine_used"] == 1.0
    assert r["metrics"]["routing_agreement_engine"] < 0.6


def test_r2_train_without_its_old_logprob_pass_is_a_named_error(tiny_hf_dir, tmp_path):
    errors = _run(tmp_path, 1, "replay-errors", tiny_hf_dir, "algo.routing_replay=r2")[0]
    assert "call compute_logprobs(batch) first" in errors["train_before_logprobs"]


def test_r3_without_routed_experts_is_a_named_error(tiny_hf_dir, tmp_path):
    errors = _run(tmp_path, 1, "replay-errors", tiny_hf_dir, "algo.routing_replay=r3")[0]
    assert "r3 needs the engine's routed experts" in errors["train_before_logprobs"]


# ----------------------------------------------------------------------------- MoE families
# Each router kind: softmax (Qwen2-MoE, Mixtral), sigmoid with an expert score bias (GLM-4.5,
# Kimi-K2), sigmoid with bias and group-limited top-k (DeepSeek-V3). The engine-agreement metric
# uses Megatron's own rule, so with the family's groups and bias it reads 1.0 on HF's routing.
ROUTER_KINDS = ["qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "kimi_k2"]


@pytest.mark.parametrize("family", ROUTER_KINDS)
def test_r3_replays_each_family_routing_exactly(family, family_dir, tmp_path):
    r = _run(tmp_path, 1, "replay-r3", family_dir(family), "algo.routing_replay=r3")[0]
    assert r["checked"] > 0 and r["mismatched"] == 0
    assert r["logprob_max_diff_vs_hf"] <= 1e-5
    assert r["metrics"]["routing_agreement_engine"] == 1.0


@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_r2_replays_each_family_routing_exactly(family, family_dir, tmp_path):
    r = _run(tmp_path, 1, "replay-r2", family_dir(family), "algo.routing_replay=r2")[0]
    assert r["checked"] > 0 and r["mismatched"] == 0
    assert r["metrics"]["routing_agreement"] < 0.6  # perturbed routers; replay held the recorded routing
    assert r["router_weights_moved"]


@pytest.mark.slow
def test_r3_deepseek_under_ep2_replays_exactly(family_dir, tmp_path):
    for r in _run(tmp_path, 2, "replay-r3", family_dir("deepseek_v3"), "algo.routing_replay=r3", "parallel.ep=2"):
        assert r["checked"] > 0 and r["mismatched"] == 0
        assert r["logprob_max_diff_vs_hf"] <= 1e-5
        assert r["metrics"]["routing_agreement_engine"] == 1.0
