"""`megatron-rlvr plan`: parameter counts against the published figures, the hand-worked
Qwen3-30B-A3B example, the per-token terms against the tensors the code allocates, the shipped
recipes on their stated node counts, and submit's refusal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rlvr.cli import main
from megatron_rlvr.config import load_config
from megatron_rlvr.plan import activations as act
from megatron_rlvr.plan.build import model_shape, plan_run, step_batch
from megatron_rlvr.plan.engines import kv_bytes_per_token
from megatron_rlvr.plan.model_state import Layout, state_bytes
from megatron_rlvr.plan.report import check
from megatron_rlvr.plan.shape import read_config_json, shape_from_hf

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "configs" / "hf-configs"

# (total, active) parameters in billions as the model cards state them
PUBLISHED = {
    "Qwen3-30B-A3B": (30.5, 3.3),
    "Qwen3-235B-A22B": (235.0, 22.0),
    "DeepSeek-V3": (671.0, 37.0),
    "Mixtral-8x7B-v0.1": (46.7, 12.9),
}
# the shipped recipes and the node count each one's comment states (8 GPUs a node)
RECIPES = {"qwen3-30b-a3b-grpo-r3.yaml": 4, "qwen3-235b-a22b-gspo.yaml": 16, "mixtral-8x7b-grpo-r3.yaml": 4}


def shape(name: str):
    return shape_from_hf(read_config_json(HF / name))


def _matches(ours: float, published: float) -> bool:
    """Within 1%, or the published figure is ours cut to its precision (model cards truncate:
    Qwen3-30B-A3B's 3.35B active is "3.3B", DeepSeek-V3's 37.55B "37B")."""
    decimals = len(str(published).split(".")[1]) if published % 1 else 0
    cut = int(ours * 10**decimals) / 10**decimals
    return abs(ours - published) <= 0.01 * published or cut == published


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_match_the_model_cards(name):
    s = shape(name)
    total, active = s.total_params() / 1e9, s.active_params() / 1e9
    assert abs(total - PUBLISHED[name][0]) <= 0.01 * PUBLISHED[name][0], total
    assert _matches(active, PUBLISHED[name][1]), active


def test_qwen3_30b_groups_and_the_hand_worked_example():
    """Notes §3: attention 0.906B, routers 0.013B, embeddings + head 0.622B, experts 28.99B; on
    8 GPUs at TP1·PP1·EP8·ETP1 with the distributed optimizer, 76.8 GB of model state per GPU."""
    s = shape("Qwen3-30B-A3B")
    counts = s.counts()
    assert round(counts["attention"] / 1e9, 3) == 0.906
    assert round(counts["routers"] / 1e9, 3) == 0.013
    assert round((counts["embedding"] + counts["output_layer"]) / 1e9, 3) == 0.622
    assert round(counts["experts"] / 1e9, 2) == 28.99
    state = state_bytes(s, Layout(1, 1, 8, 8, 1), 0, dtype="bfloat16", distributed=True, norms_fp32=False)
    assert round(state.total / 1e9, 1) == 76.8
    # 16 GPUs (expert-DP 2): 53.9 GB
    state = state_bytes(s, Layout(1, 1, 16, 8, 1), 0, dtype="bfloat16", distributed=True, norms_fp32=False)
    assert round(state.total / 1e9, 1) == 53.9


def test_kv_cache_per_token_replicates_heads_and_compresses_mla():
    s = shape("Qwen3-30B-A3B")  # 48 layers × 4 KV heads × 128 × 2 (K, V) × 2 B
    assert kv_bytes_per_token(s, 1, "bfloat16") == 98_304
    assert kv_bytes_per_token(s, 4, "bfloat16") == 98_304 // 4
    assert kv_bytes_per_token(s, 8, "bfloat16") == kv_bytes_per_token(s, 4, "bfloat16")  # heads replicated
    ds = shape("DeepSeek-V3")  # (kv_lora_rank 512 + rope 64) × 61 layers × 2 B, on every TP rank
    assert kv_bytes_per_token(ds, 1, "bfloat16") == kv_bytes_per_token(ds, 8, "bfloat16") == 576 * 61 * 2


def test_chunk_size_is_the_learners():
    from megatron_rlvr.learner import logits

    assert act.CHUNK_BYTES == logits.CHUNK_BYTES


def test_r3_terms_equal_the_tensors_the_code_allocates():
    from megatron_rlvr.learner.routing_replay import local_token_order
    from megatron_rlvr.rollout.routed_experts import pack_routed_experts

    s = shape("Qwen3-30B-A3B")
    rows, width = 3, 40
    rng = np.random.default_rng(0)
    per_sample = [rng.integers(0, 128, (width - 1, 48, 8)).astype(np.uint8) for _ in range(rows)]
    host = pack_routed_experts(
        per_sample, [width] * rows, width, num_layers=48, top_k=8, sample_ids=[str(i) for i in range(rows)]
    )
    batch = act.Batch(
        seq_len=width, train_tokens=0, logprob_tokens=0, micro_batches=1, rows_per_rank=1, batch_rows=rows
    )
    assert act.r3_host_bytes(s, batch) == host.nbytes
    # one micro-batch of 2 rows on a TP 2 rank under sequence parallelism, pipeline stage 0 of 2
    layout = Layout(tp=2, pp=2, dp=1, ep=1, etp=1)
    local = local_token_order(host[:2], tp_rank=0, tp_size=2, sequence_parallel=True)
    targets = [local[:, layer].long() for layer in range(24)]  # the stage's 24 MoE layers, as set on routers
    assert act.r3_device_bytes(s, layout, 0, 2 * width, sp=2, micro_batches=1) == sum(t.nbytes for t in targets)


def test_logits_term_is_the_logits_and_the_chunks():
    s = shape("Qwen3-30B-A3B")
    layout = Layout(tp=2, pp=1, dp=1, ep=1, etp=1)
    tokens, vocab_local = 1000, 151_936 // 2
    logits = torch.empty(tokens, vocab_local, dtype=torch.bfloat16)
    rows = act.CHUNK_BYTES // (4 * vocab_local)
    chunk = torch.empty(rows, vocab_local, dtype=torch.float32)
    assert act.logits_bytes(s, layout, tokens, 2, train=False) == logits.nbytes + 2 * chunk.nbytes
    assert act.logits_bytes(s, layout, tokens, 2, train=True) == 2 * logits.nbytes + 2 * chunk.nbytes


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_shipped_recipe_fits_its_nodes(recipe):
    cfg = load_config(ROOT / "configs" / recipe)
    plan = plan_run(cfg, gpu_gb=80.0)
    check(plan)  # raises when a GPU is over its memory
    assert plan.learner and plan.learner.device_bytes <= 80e9
    assert plan.engine_memory and plan.engine_memory.concurrent_tokens >= step_batch(cfg, 1024).seq_len
    p, e = cfg.parallel, cfg.rollout
    assert p.tp * p.pp * p.dp + e.num_engines * e.engine.tp <= RECIPES[recipe] * 8  # type: ignore[union-attr]


def test_plan_command_prints_the_terms(capsys):
    config = str(ROOT / "configs" / "qwen3-30b-a3b-grpo-r3.yaml")
    assert main(["plan", config, "--nodes", "4", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    for term in ("parameters", "gradients", "optimizer", "activations", "logits", "routing replay", "KV cache"):
        assert f"  {term} " in out, term
    assert "weight sync: 61.06 GB per sync" in out


def test_submit_refuses_a_layout_over_memory_in_one_line(capsys, tmp_path):
    """Qwen3-30B-A3B's learner on 4 GPUs (EP 4, expert-DP 1): the optimizer alone is over 80 GB."""
    config = str(ROOT / "configs" / "qwen3-30b-a3b-grpo-r3.yaml")
    small = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "parallel.ep=4", "rollout.num_engines=1"]
    args = ["submit", config, *small, f"trainer.output_dir={tmp_path}", "--nodes", "1", "--gpus-per-node", "8"]
    assert main([*args, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert not captured.out  # no script
    refusal = captured.err.splitlines()[-1]
    assert refusal.startswith("megatron-rlvr submit: the most loaded learner rank needs 162.1 GB of 80 GB")
    assert "largest term: optimizer" in refusal and "parallel.ep" in refusal and "--no-memory-check" in refusal
    assert main([*args, "--dry-run", "--no-memory-check"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("#!")
    assert "warning: the most loaded learner rank needs 162.1 GB" in captured.err


def test_submit_warns_above_90_percent(capsys, tmp_path):
    config = str(ROOT / "configs" / "qwen3-30b-a3b-grpo-r3.yaml")
    args = ["submit", config, f"trainer.output_dir={tmp_path}", "--nodes", "4", "--gpus-per-node", "8", "--dry-run"]
    assert main([*args, "--gpu-memory", "48"]) == 0
    assert "warning: the most loaded learner rank needs 44.1 GB, 92% of 48 GB" in capsys.readouterr().err


def test_plan_runs_without_torch():
    """A login node: the command must not import torch (it reads config.json only)."""
    code = (
        "import sys; from megatron_rlvr.cli import main; "
        f"main(['plan', {str(ROOT / 'configs' / 'mixtral-8x7b-grpo-r3.yaml')!r}, '--nodes', '4', "
        "'--gpus-per-node', '8']); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_docs_show_each_recipes_plan_as_the_command_prints_it(recipe, capsys):
    assert main(["plan", str(ROOT / "configs" / recipe), "--nodes", str(RECIPES[recipe]), "--gpus-per-node", "8"]) == 0
    captured = capsys.readouterr()
    shown = "\n".join(captured.out.splitlines()[4:])  # the plan itself, after the GPU counts
    assert f"```text\n{shown}\n```" in (ROOT / "docs" / "slurm.md").read_text()


def test_qk_norm_inputs_count_as_activations():
    """Qwen3's q and k norms keep their inputs (the qkv projection's q and k) for backward:
    the same layer with use_qk_norm keeps a·(n_q + n_kv)·d/tp more bytes per token."""
    raw = read_config_json(HF / "Mixtral-8x7B-v0.1")  # 32 query heads, 8 KV heads of 128
    layout = Layout(tp=2, pp=1, dp=1, ep=1, etp=1)
    plain = act.layer_bytes_per_token(shape_from_hf(raw), 0, layout, 2, 2)
    normed = act.layer_bytes_per_token(shape_from_hf({**raw, "use_qk_norm": True}), 0, layout, 2, 2)
    assert normed - plain == 2 * (32 + 8) * 128 // 2


# Each recipe's model state (bf16 weights, fp32 gradients, Adam; bytes on the most loaded GPU) as
# Megatron's estimators give it, run unmodified (docs/slurm.md, "Against Megatron's estimators"):
# (Megatron-LM d98e8a64 compute_weight_and_optimizer_memory,
#  Megatron-Bridge 067f987d estimate_training_memory(...).weight_and_optimizer_bytes)
ESTIMATED_STATE = {
    "qwen3-30b-a3b-grpo-r3.yaml": (36_112_278_528, 36_055_655_424),
    "qwen3-235b-a22b-gspo.yaml": (71_510_019_072, 71_323_756_032),
    "mixtral-8x7b-grpo-r3.yaml": (54_349_940_736, 54_345_222_144),
}


@pytest.mark.parametrize("recipe", list(ESTIMATED_STATE))
def test_model_state_equals_megatrons_estimators_but_for_the_named_terms(recipe):
    """Both estimators charge 6 + 12/DP bytes per parameter (bf16 weight, fp32 gradient, fp32
    master + Adam over the optimizer's shard), as the plan does; they differ from the plan only
    in which parameters a GPU holds, each difference named here."""
    cfg = load_config(ROOT / "configs" / recipe)
    p = cfg.parallel
    s = model_shape(cfg)
    layout = Layout(p.tp, p.pp, p.dp, p.ep, p.etp)
    ours = max(
        state_bytes(s, layout, stage, dtype="bfloat16", distributed=True, norms_fp32=False).total
        for stage in range(p.pp)
    )
    per_param = 6 + 12 / p.dp  # dense parameters; the experts (18 B at expert-DP 1) agree exactly
    h, layers = s.hidden, s.num_layers // p.pp
    vocab_pad = (-s.vocab % (128 * p.tp)) * h / p.tp  # Megatron pads V to 128·tp; the learner does not
    qk_norms = 2 * s.head_dim * layers if s.model_type == "qwen3_moe" else 0  # neither estimator counts them
    mlm, bridge = ESTIMATED_STATE[recipe]
    # Megatron-LM: spreads the final norm over the stages (the plan: whole on the last)
    final_norm = h - h / p.pp
    assert ours == pytest.approx(mlm + per_param * (qk_norms + final_norm - vocab_pad), abs=1)
    # Megatron-Bridge: no router weights; norms as LayerNorm (weight + bias), split over TP
    routers = s.num_experts * h * layers
    norms = 2 * h * layers + qk_norms + h - (4 * h * s.num_layers + 2 * h) / (p.pp * p.tp)
    assert ours == pytest.approx(bridge + per_param * (routers + norms - vocab_pad), abs=1)
    assert abs(ours / mlm - 1) < 1e-4 and abs(ours / bridge - 1) < 3e-3
