"""Tiny random fp32 HF checkpoints of each MoE family, built with transformers and saved with
save_pretrained, shaped as the real models are (DeepSeek-V3's group-limited sigmoid routing with
an expert score bias, first dense layers, MLA and YaRN; Mixtral's block_sparse_moe names;
Qwen2-MoE's gated shared expert; GLM-4.5's partial rotary and qkv bias). Nothing is downloaded.

    build_family(name, out_dir) -> out_dir
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96  # divisible by every tensor-parallel size the tests use
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
)

# DeepSeek-V3's YaRN block (factor 40 over 4096 positions), scaled to the tiny context
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _deepseek(**over):
    from transformers import DeepseekV3Config

    args = dict(
        _COMMON,
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
        rope_parameters=dict(_YARN),
    )
    args.update(over)
    return DeepseekV3Config(**args)


def _configs() -> dict:
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig

    return {
        "qwen2_moe": lambda: Qwen2MoeConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=True,
        ),
        "mixtral": lambda: MixtralConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.0,
        ),
        "glm4_moe": lambda: Glm4MoeConfig(
            **_COMMON,
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            use_qk_norm=False,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
        # group-limited routing (4 groups, best 2), YaRN, MLA with a q LoRA, one dense layer
        "deepseek_v3": lambda: _deepseek(),
        # Moonlight: DeepSeek-V3's architecture without q LoRA or groups, plain RoPE
        "moonlight": lambda: _deepseek(
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        ),
        # Kimi-K2: DeepSeek-V3's architecture under model_type kimi_k2, one group
        "kimi_k2": lambda: _deepseek(n_group=1, topk_group=1, num_experts_per_tok=2),
    }


FAMILIES = tuple(_configs())


def build_family(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    config = _configs()[name]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for module_name, buffer in model.named_buffers():
            if module_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))  # trained checkpoints carry a bias
    out = Path(out_dir)
    model.save_pretrained(out)
    if name == "kimi_k2":  # as Kimi-K2 ships it: its own model_type over DeepSeek-V3's layout
        config_path = out / "config.json"
        raw = json.loads(config_path.read_text())
        raw.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
        config_path.write_text(json.dumps(raw, indent=2))
    return out


def hf_model(model_dir: str | Path):
    """The HF transformers model of a checkpoint, read as the project reads it (kimi_k2 as
    deepseek_v3: Kimi-K2 ships DeepSeek-V3's modelling code)."""
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.families import read_hf_config

    return AutoModelForCausalLM.from_pretrained(str(model_dir), config=read_hf_config(model_dir), dtype=torch.float32)


def hf_forward_with_routing(model, ids: torch.Tensor):
    """HF's forward and the experts its own routers chose, [B, T, num_hidden_layers, k] (dense
    layers zero): hooks on each MoE layer's router, whose last output is the chosen ids, so
    every family's rule (softmax, sigmoid with score bias, group-limited) is HF's own."""
    from megatron_rlvr.families import family_of

    router_attr = family_of(model.config).router
    k = model.config.num_experts_per_tok
    chosen: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        router = getattr(getattr(layer, "mlp", None), router_attr, None)
        if router is not None and hasattr(router, "top_k"):
            hooks.append(
                router.register_forward_hook(
                    lambda module, args, output, index=index: chosen.__setitem__(index, output[-1].detach())
                )
            )
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    routing = torch.zeros(*ids.shape, model.config.num_hidden_layers, k, dtype=torch.long)
    for index, ids_chosen in chosen.items():
        routing[:, :, index] = ids_chosen.view(*ids.shape, k)
    return out, routing


def add_mtp_layer(model_dir: str | Path) -> int:
    """Adds one multi-token-prediction layer to a DeepSeek-V3 checkpoint, stored as DeepSeek-V3
    ships it (`model.layers.<num_hidden_layers>.*`: a decoder layer plus enorm, hnorm, eh_proj
    and shared_head.norm). Returns how many tensors were added."""
    from safetensors.torch import load_file, save_file

    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    added = {mtp + name[len(last) :]: t.clone() for name, t in tensors.items() if name.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    added.update(
        {
            mtp + "enorm.weight": torch.ones(hidden),
            mtp + "hnorm.weight": torch.ones(hidden),
            mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden),
            mtp + "shared_head.norm.weight": torch.ones(hidden),
        }
    )
    save_file({**tensors, **added}, str(path), metadata={"format": "pt"})
    return len(added)
