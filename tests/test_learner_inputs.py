"""Bad input to the learner fails early, in one line, naming the problem."""

import json

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.learner import cpu_compat
from megatron_rlvr.learner.model import UnsupportedArchitecture, read_hf_config
from megatron_rlvr.learner.parallel import Rendezvous, init_parallel


def test_the_config_accepts_exactly_the_architectures_the_learner_builds():
    from megatron_rlvr.config import SUPPORTED_MODEL_TYPES
    from megatron_rlvr.families import ALIASES
    from megatron_rlvr.learner.model import ARCHITECTURES

    assert set(SUPPORTED_MODEL_TYPES) == set(ARCHITECTURES) | set(ALIASES)
    assert set(ALIASES.values()) <= set(ARCHITECTURES)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(
        UnsupportedArchitecture,
        match=r"'llama' .* not supported \(supported: deepseek_v3, glm4_moe, gpt_oss, kimi_k2, mixtral, qwen2_moe, qwen3_moe\)",
    ):
        read_hf_config(tmp_path)


def test_a_group_limit_megatron_would_rank_otherwise_than_hf_is_refused(tmp_path):
    """DeepSeek-V3 (8 experts per token, 4 of 8 groups) ranks groups by their top 2 both in HF and
    in Megatron; a config where k / topk_group != 2 would route differently in the learner."""
    from transformers import DeepseekV3Config

    shape = dict(hidden_size=64, num_attention_heads=4, n_routed_experts=16, n_group=4, q_lora_rank=32)
    DeepseekV3Config(**shape, num_experts_per_tok=6, topk_group=2).save_pretrained(tmp_path / "bad")
    with pytest.raises(
        UnsupportedArchitecture, match=r"n_group 4 with num_experts_per_tok 6 and topk_group 2: .*top 3"
    ):
        read_hf_config(tmp_path / "bad")
    DeepseekV3Config(**shape, num_experts_per_tok=4, topk_group=2).save_pretrained(tmp_path / "good")
    assert read_hf_config(tmp_path / "good").n_group == 4


def test_world_size_must_match_the_layout_before_any_group_starts():
    cfg = load_config(None, ["parallel.tp=2"])
    with pytest.raises(ValueError, match=r"world size 3 != parallel.tp · pp · dp = 2·1·1 = 2"):
        init_parallel(cfg.parallel, Rendezvous(rank=0, world_size=3))


def test_cpu_compat_refuses_an_untested_megatron_core(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(cpu_compat.CpuCompatError, match=r"0.99.0 is not the version .* \(0.16.1\)"):
        cpu_compat.check_version()


def test_layouts_that_do_not_divide_the_model_fail_in_the_config():
    with pytest.raises(ValueError, match="parallel.ep = 3"):
        load_config(None, ["parallel.ep=3"])
