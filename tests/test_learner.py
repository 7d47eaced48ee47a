"""The Megatron-Core learner in real gloo worlds of 1 and 2 processes on tiny Qwen3-MoE (and, for
parity, gpt-oss) models built here: parity with HF transformers and with world size 1, export, checkpoints, descent."""

import pytest
import torch
from distributed import run_ranks

LAYOUTS = {
    "ep2": ["parallel.ep=2"],
    "tp2-sp": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2"],
    "tp2-ep2-etp1": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
}


# gpt-oss: sinks, sliding window, YaRN, biases everywhere. Megatron takes MoE biases only at
# expert TP 1, and TP 2 with EP 1 and expert TP 1 leaves each rank's expert gradients partial
# (the config refuses it; see test_config): gpt-oss's TP layout is the one with EP 2
MODELS = {"qwen3_moe": [], "gpt_oss": ["parallel.etp=1"]}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tiny_hf_dir, tiny_gpt_oss_dir) -> tuple[str, list[str]]:
    """(checkpoint, overrides every layout of this model needs)."""
    return str(tiny_gpt_oss_dir if request.param == "gpt_oss" else tiny_hf_dir), MODELS[request.param]


@pytest.fixture(scope="module")
def world1(model, tmp_path_factory):
    return run_ranks(1, ["parity", model[0]], tmp_path_factory.mktemp("world1"))[0]


def test_world1_matches_hf_and_exports_bitwise(world1):
    assert world1["logprob_max_diff_vs_hf"] <= 1e-5
    assert world1["exported_names_match"] and world1["export_bitwise_equal"]
    assert world1["export_changed_after_training"]
    m = world1["metrics"]
    assert m["grad_norm"] > 0 and torch.isfinite(torch.tensor(m["policy_loss"]))
    assert 0.0 <= m["clipfrac"] <= 1.0 and "rollout_is_mean" in m and "mismatch_k3_kl" in m


# EP 2 and TP 2 (+SP) alone are in the slow tier: tp2-ep2-etp1 holds both, and each alone is
# checked against world 1 by the budgeted-step, weight-sync, R3 and SFT tests
@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.slow) if k in ("ep2", "tp2-sp") else k for k in LAYOUTS]
)
def test_two_process_layout_equals_world1(layout, world1, model, tmp_path):
    if model[1] and layout == "tp2-sp":
        pytest.skip("expert biases need expert TP 1, which TP 2 takes only with EP 2 (tp2-ep2-etp1)")
    results = run_ranks(2, ["parity", model[0], *LAYOUTS[layout], *model[1]], tmp_path)
    for rank, r in enumerate(results):
        assert r["logprob_max_diff_vs_hf"] <= 1e-5, (rank, r["logprob_max_diff_vs_hf"])
        assert r["exported_names_match"] and r["export_bitwise_equal"], rank
        ours, ref = r["metrics"], world1["metrics"]
        assert ours["policy_loss"] == pytest.approx(ref["policy_loss"], rel=1e-5, abs=1e-7)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert ours["clipfrac"] == pytest.approx(ref["clipfrac"], abs=1e-6)
        assert ours["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)  # vocab-sharded under TP
        after = torch.tensor(r["logprobs_after_step"])
        assert (after - torch.tensor(world1["logprobs_after_step"])).abs().max() <= 1e-5


def test_checkpoint_saved_at_tp2_loads_at_ep2(tiny_hf_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(2, ["ckpt-save", str(tiny_hf_dir), str(ckpt), *LAYOUTS["tp2-sp"]], tmp_path)
    (tmp_path / "load").mkdir()
    loaded = run_ranks(2, ["ckpt-load", str(tiny_hf_dir), str(ckpt), *LAYOUTS["ep2"]], tmp_path / "load")
    assert loaded[0]["step"] == 1
    diff = torch.tensor(loaded[0]["logprobs"]) - torch.tensor(saved[0]["logprobs"])
    assert diff.abs().max() <= 1e-5


def test_checkpoint_resume_in_same_layout_continues_identically(tiny_hf_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(2, ["ckpt-save", str(tiny_hf_dir), str(ckpt), *LAYOUTS["ep2"]], tmp_path)
    (tmp_path / "load").mkdir()
    loaded = run_ranks(2, ["ckpt-load", str(tiny_hf_dir), str(ckpt), *LAYOUTS["ep2"]], tmp_path / "load")
    assert torch.equal(torch.tensor(loaded[0]["logprobs"]), torch.tensor(saved[0]["logprobs"]))
    # optimizer moments, step count and LR schedule came back: the next step is the same
    assert torch.equal(torch.tensor(loaded[0]["logprobs_next"]), torch.tensor(saved[0]["logprobs_next"]))


@pytest.mark.gpu
def test_world1_on_cuda_matches_hf_logprobs_trains_and_exports(tiny_hf_dir, tmp_path):
    # GPU-only: NCCL and the transformer-engine spec (scripts/gpu_check.py step "learner-hf").
    # Every learner collective (the logprob all-gather, the metric and routing-agreement
    # reductions) then runs on NCCL, which takes no CPU tensor. fp32; TE's GEMMs may use TF32.
    r = run_ranks(1, ["parity", str(tiny_hf_dir), "parallel.device=cuda"], tmp_path)[0]
    assert r["logprob_max_diff_vs_hf"] <= 1e-2, r["logprob_max_diff_vs_hf"]
    assert r["exported_names_match"] and r["export_bitwise_equal"] and r["export_changed_after_training"]
    assert r["metrics"]["grad_norm"] > 0


def test_a_checkpoint_made_on_gpu_resumes_on_cpu_without_its_cuda_rng_states(tiny_hf_dir, tmp_path):
    # A CUDA rank saves its CUDA generator's and Megatron tracker's Philox states; a CPU
    # learner cannot take them (nor the reverse), so they come back only on the same device
    # type, and the weights, optimizer and step still do.
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(1, ["ckpt-save", str(tiny_hf_dir), str(ckpt)], tmp_path, env={"SAVE_AS_GPU": "1"})
    (tmp_path / "load").mkdir()
    loaded = run_ranks(1, ["ckpt-load", str(tiny_hf_dir), str(ckpt)], tmp_path / "load")
    assert loaded[0]["step"] == 1
    assert torch.equal(torch.tensor(loaded[0]["logprobs"]), torch.tensor(saved[0]["logprobs"]))
    assert torch.equal(torch.tensor(loaded[0]["logprobs_next"]), torch.tensor(saved[0]["logprobs_next"]))


@pytest.mark.gpu
def test_checkpoint_made_on_cpu_loads_on_gpu_and_one_made_on_gpu_resumes_on_both(tiny_hf_dir, tmp_path):
    # GPU-only: the transformer-engine spec and CUDA's RNG states exist only there
    # (scripts/gpu_check.py step "checkpoint"). fp32 throughout; TE's kernels differ from the
    # local spec's in rounding only.
    def ranks(name: str, *args: str) -> dict:
        (tmp_path / name).mkdir()
        return run_ranks(1, [args[0], str(tiny_hf_dir), *args[1:]], tmp_path / name)[0]

    def gap(a: dict, b: dict, key: str) -> float:
        return float((torch.tensor(a[key]) - torch.tensor(b[key])).abs().max())

    cpu = ranks("cpu-save", "ckpt-save", str(tmp_path / "cpu-ckpt"))
    on_gpu = ranks("gpu-load", "ckpt-load", str(tmp_path / "cpu-ckpt"), "parallel.device=cuda")
    assert on_gpu["step"] == 1 and gap(on_gpu, cpu, "logprobs") <= 1e-4
    gpu = ranks("gpu-save", "ckpt-save", str(tmp_path / "gpu-ckpt"), "parallel.device=cuda")
    resumed = ranks("gpu-resume", "ckpt-load", str(tmp_path / "gpu-ckpt"), "parallel.device=cuda")
    assert gap(resumed, gpu, "logprobs") <= 1e-6 and gap(resumed, gpu, "logprobs_next") <= 1e-5
    on_cpu = ranks("cpu-load", "ckpt-load", str(tmp_path / "gpu-ckpt"))
    assert on_cpu["step"] == 1 and gap(on_cpu, gpu, "logprobs") <= 1e-4


# (MiniRL's value jumps where a token leaves its range: its mask zeroes the token's term)
# GSPO and OPMD in the slow tier: their losses and gradients equal closed forms in
# test_losses.py and test_reinforce_family.py; descent in the real learner is shown by GRPO and REC
@pytest.mark.parametrize("kind", ["grpo", "rec", *(pytest.param(k, marks=pytest.mark.slow) for k in ("gspo", "opmd"))])
def test_policy_loss_goes_down_on_a_fixed_batch(kind, tiny_hf_dir, tmp_path):
    # GSPO's own clip range (±4e-4 on the sequence ratio) bounds how far its loss can move on
    # a fixed batch; a wide clip lets the test see its gradient drive the loss down.
    clip = ["algo.clip_low=0.2", "algo.clip_high=0.2"] if kind == "gspo" else []
    losses = run_ranks(
        1,
        ["descent", str(tiny_hf_dir), f"algo.kind={kind}", "trainer.lr=3e-3", "algo.num_minibatches=1", *clip],
        tmp_path,
    )[0]["losses"]
    assert losses[-1] < losses[0] - 1e-3, losses
    assert all(b <= a + 1e-6 for a, b in zip(losses, losses[1:])), losses


def test_two_epochs_equal_two_one_epoch_steps_on_the_same_batch(tiny_hf_dir, tmp_path):
    """algo.epochs = 2 (verl's ppo_epochs) is two passes of the same num_minibatches optimizer
    steps over one batch: the weights after it equal two one-pass train steps on that batch
    (constant lr), and the second pass's drift is reported on its own."""
    common = [str(tiny_hf_dir), "algo.num_minibatches=2", "trainer.lr=3e-3", "trainer.lr_decay_style=constant"]
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    two = run_ranks(1, ["epochs-x1", *common, "algo.epochs=2"], tmp_path / "two")[0]
    one = run_ranks(1, ["epochs-x2", *common, "algo.epochs=1"], tmp_path / "one")[0]
    gap = (torch.tensor(two["logprobs"]) - torch.tensor(one["logprobs"])).abs().max().item()
    assert gap <= 1e-6, gap
    (both,) = two["metrics"]
    first, second = one["metrics"]
    assert both["last_epoch/approx_kl"] == pytest.approx(second["approx_kl"], abs=1e-9)
    assert both["approx_kl"] == pytest.approx((first["approx_kl"] + second["approx_kl"]) / 2, abs=1e-9)
    assert second["approx_kl"] > first["approx_kl"]  # the second pass is off-policy
    assert "last_epoch/approx_kl" not in first


@pytest.mark.parametrize(
    "layout",
    [[], LAYOUTS["tp2-sp"], pytest.param(["parallel.device=cuda"], marks=pytest.mark.gpu)],
    ids=["world1", "tp2", "cuda"],
)
def test_chunked_logprobs_and_entropy_from_vocab_sharded_logits_equal_the_closed_form(layout, tiny_hf_dir, tmp_path):
    world = 2 if layout and "parallel.device=cuda" not in layout else 1  # one GPU: world 1
    for r in run_ranks(world, ["entropy", str(tiny_hf_dir), *layout], tmp_path):
        for rows, d in r.items():
            assert d["logprob_diff"] <= 1e-5 and d["value_diff"] <= 1e-5 and d["grad_diff"] <= 1e-6, (rows, d)


@pytest.mark.slow  # a learning-dynamics run
def test_the_entropy_bonus_keeps_the_policy_from_sharpening(tiny_hf_dir, tmp_path):
    def entropies(coef: float) -> list[float]:
        (tmp_path / str(coef)).mkdir()
        return run_ranks(
            1,
            ["descent", str(tiny_hf_dir), "trainer.lr=3e-3", "algo.num_minibatches=1", f"algo.entropy_coef={coef}"],
            tmp_path / str(coef),
        )[0]["entropies"]

    plain, bonus = entropies(0.0), entropies(1.0)
    assert plain[0] == pytest.approx(bonus[0])  # same start
    assert bonus[-1] > bonus[0] and bonus[-1] > plain[-1] + 1e-3, (plain, bonus)


# ----------------------------------------------------------------------------- MoE families
# Every family in world 1; DeepSeek-V3 (group-limited routing, score bias, MLA, YaRN) also in
# the 2-process layouts by default, the others under `slow`.
FAMILIES = ["qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "moonlight", "kimi_k2"]
FAMILY_LAYOUTS = [
    pytest.param(f, layout, marks=() if f == "deepseek_v3" else pytest.mark.slow, id=f"{f}-{layout}")
    for f in ("deepseek_v3", "glm4_moe", "qwen2_moe", "mixtral")
    for layout in ("ep2", "tp2-sp")
]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_and_exports_bitwise_in_world1(family, family_dir, tmp_path):
    r = run_ranks(1, ["parity", str(family_dir(family))], tmp_path)[0]
    assert r["logprob_max_diff_vs_hf"] <= 1e-5, r["logprob_max_diff_vs_hf"]
    assert r["exported_names_match"] and r["export_bitwise_equal"]  # expert score bias included
    assert r["export_changed_after_training"]
    assert not r["expert_bias_moved"]  # frozen by default (trainer.expert_bias_update_rate = 0)


@pytest.mark.parametrize("family, layout", FAMILY_LAYOUTS)
def test_family_two_process_layout_matches_hf(family, layout, family_dir, tmp_path):
    for rank, r in enumerate(run_ranks(2, ["parity", str(family_dir(family)), *LAYOUTS[layout]], tmp_path)):
        assert r["logprob_max_diff_vs_hf"] <= 1e-5, (rank, r["logprob_max_diff_vs_hf"])
        assert r["exported_names_match"] and r["export_bitwise_equal"], rank


def test_deepseek_mtp_layer_is_skipped_on_purpose_and_said_in_the_log(tmp_path):
    from tiny_families import add_mtp_layer, build_family

    hf_dir = build_family("deepseek_v3", tmp_path / "hf")
    added = add_mtp_layer(hf_dir)
    r = run_ranks(1, ["parity", str(hf_dir)], tmp_path)[0]
    assert r["mtp_tensors_skipped"] == added
    assert r["logprob_max_diff_vs_hf"] <= 1e-5 and r["exported_names_match"] and r["export_bitwise_equal"]
    log = (tmp_path / "rank0.log").read_text()
    assert f"skipping the checkpoint's {added} multi-token-prediction tensors (model.layers.3." in log


def test_expert_bias_moves_only_when_asked(family_dir, tmp_path):
    r = run_ranks(1, ["parity", str(family_dir("deepseek_v3")), "trainer.expert_bias_update_rate=0.01"], tmp_path)[0]
    assert r["expert_bias_moved"]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_model_checkpoints_carry_the_transformer_engine_specs_keys_both_ways(family, tiny_hf_dir, family_dir, tmp_path):
    # The GPU learner builds Megatron's transformer-engine spec, the CPU learner its local
    # spec; they key some norms differently: an MoE layer's pre-MLP norm, and under MLA
    # (DeepSeek-V3, one dense layer first) the dense layer's pre-MLP norm and the q and kv
    # norms, which TE fuses into the next linear. Checkpoints use the TE spec's keys
    # (mbridge's TE names, stacked as Megatron stacks them), and a CPU model loads both a
    # TE-keyed checkpoint (with TE-only extra state) and one in the old keys.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    hf_dir = tiny_hf_dir if family == "qwen3_moe" else family_dir(family)
    r = run_ranks(1, ["ckpt-specs", str(hf_dir), str(ckpt)], tmp_path)[0]
    assert r["written"] == r["expected"]
    if family == "qwen3_moe":
        assert "decoder.layers.pre_mlp_layernorm.weight" in r["written"]
        assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in r["written"]
    else:  # layer 0 dense, 1 and 2 MoE: keyed per layer
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in r["written"]
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in r["written"]
        assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in r["written"]
        assert "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight" in r["written"]
        assert not any("pre_mlp_layernorm" in key for key in r["written"] if key.startswith("decoder.layers.0."))
    assert r["loaded"] == {"te": True, "legacy": True}


def test_a_cpu_run_on_a_machine_with_gpus_stays_on_the_cpu(world1, model, tiny_hf_dir, tmp_path):
    # parallel.device decides, not torch.cuda.is_available(): with CUDA reported available
    # (and any real CUDA call failing, this torch has none) the CPU learner runs as before.
    gpu_host = {"SIMULATE_GPU_HOST": "1"}
    r = run_ranks(1, ["parity", model[0]], tmp_path, env=gpu_host)[0]
    assert r["logprob_max_diff_vs_hf"] <= 1e-5 and r["export_bitwise_equal"]
    assert r["metrics"]["policy_loss"] == world1["metrics"]["policy_loss"]
    if model[0] != str(tiny_hf_dir):
        return  # checkpoints on a GPU host: once, on Qwen3-MoE
    saved = run_ranks(1, ["ckpt-save", str(tiny_hf_dir), str(tmp_path / "ckpt")], tmp_path, env=gpu_host)[0]
    (tmp_path / "load").mkdir()
    loaded = run_ranks(1, ["ckpt-load", str(tiny_hf_dir), str(tmp_path / "ckpt")], tmp_path / "load", env=gpu_host)[0]
    assert loaded["step"] == 1 and loaded["logprobs_next"] == saved["logprobs_next"]
