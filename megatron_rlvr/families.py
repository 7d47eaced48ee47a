"""The MoE families the project runs, one row each: how the learner builds the family through
mbridge (bridge class, Megatron settings the bridge leaves out, config fixes for transformers 5)
and what the CPU engine must know of its HF modules (router attribute, checkpoint names).

Plain Python: no torch import, so the config schema reads the supported list from here.
Transformers is imported only inside `read_hf_config`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rlvr.errors import UserError

# config.json keys that hold the routed-expert count, by family spelling
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


@dataclass(frozen=True)
class Family:
    """How to build, load, route and serve one HF `model_type`."""

    bridge_class: str  # "module:Class" of the bridge (mbridge's, or one of ours)
    # Megatron TransformerConfig settings the bridge leaves out or sets wrong for this family,
    # from the (fixed) HF config; applied over the bridge's own
    settings: Callable[[Any], dict] = lambda hf: {}
    # bridge config keys the installed Megatron-Core no longer takes
    drop_config_keys: tuple[str, ...] = ()
    # fixes to the transformers config object (in place) so the bridge reads it right
    fix_config: Callable[[Any], None] = lambda hf: None
    # the attribute of a decoder layer's `mlp` that routes (returns the chosen ids last)
    router: str = "gate"
    # checkpoint names of one expert's gate / up / down weights (`…experts.E.<name>.weight`)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # checkpoint spelling of runtime module paths: (runtime part, checkpoint part)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # the router carries an expert score bias (persistent, not a gradient parameter)
    expert_bias: bool = False
    # the checkpoint stores each layer's experts fused, as transformers holds them
    # (`experts.gate_up_proj` [E, ...]): names are the runtime ones, no per-expert views
    fused_experts: bool = False


def _head_dim(hf) -> None:
    """transformers 5 sets head_dim=None where the config leaves it out (Mixtral)."""
    if getattr(hf, "head_dim", None) is None:
        hf.head_dim = hf.hidden_size // hf.num_attention_heads


def _rope_parameters(hf) -> dict:
    return dict(getattr(hf, "rope_parameters", None) or {})


def _glm4_moe_config(hf) -> None:
    """transformers 5 moved partial_rotary_factor into rope_parameters; the bridge reads the
    attribute."""
    rope = _rope_parameters(hf)
    if getattr(hf, "partial_rotary_factor", None) is None and "partial_rotary_factor" in rope:
        hf.partial_rotary_factor = rope["partial_rotary_factor"]


def _deepseek_v3_config(hf) -> None:
    """Refuses group limits Megatron would apply differently: it ranks a group by the sum of its
    top k/topk_group scores, HF and SGLang by their top 2, so the learner would route otherwise
    than the checkpoint's code and the engines."""
    groups = getattr(hf, "n_group", None) or 1
    if groups > 1 and hf.num_experts_per_tok != 2 * hf.topk_group:
        raise UnsupportedArchitecture(
            f"n_group {groups} with num_experts_per_tok {hf.num_experts_per_tok} and topk_group "
            f"{hf.topk_group}: Megatron-Core ranks expert groups by their top "
            f"{hf.num_experts_per_tok // hf.topk_group} scores, HF and SGLang by their top 2 "
            "(supported: num_experts_per_tok = 2 · topk_group, as in DeepSeek-V3, or n_group 1)"
        )


def _deepseek_v3_settings(hf) -> dict:
    groups = getattr(hf, "n_group", None) or 1
    settings = {
        # group-limited routing: the best topk_group of n_group expert groups, then top-k in them
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": hf.topk_group if groups > 1 else None,
        # an MTP layer in the checkpoint is not built: RL trains the main model only, and the
        # loader says in the log that it skips the checkpoint's MTP tensors
        "mtp_num_layers": None,
    }
    # the bridge reads YaRN from `rope_scaling`, which transformers 5 keeps in `rope_parameters`:
    # unread, a YaRN checkpoint would get plain RoPE, silently
    rope = _rope_parameters(hf)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "yarn":
        settings.update(
            rope_type="yarn",
            rotary_scaling_factor=rope["factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
            beta_fast=rope.get("beta_fast", 32),
            beta_slow=rope.get("beta_slow", 1),
            mscale=rope.get("mscale", 1.0),
            mscale_all_dim=rope.get("mscale_all_dim", 0.0),
        )
    elif rope_type == "default":
        settings["rope_type"] = "rope"
    else:
        raise UnsupportedArchitecture(
            f"rope_type {rope_type!r} of a deepseek_v3 model is not supported (supported: default, yarn)"
        )
    return settings


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(bridge_class="mbridge.models.qwen3moe:Qwen3MoEBridge"),
    "qwen2_moe": Family(
        bridge_class="mbridge.models.qwen2moe:Qwen2MoEBridge",
        # the bridge maps shared_expert_gate but never switches the gate on
        settings=lambda hf: {"moe_shared_expert_gate": True},
    ),
    "mixtral": Family(
        bridge_class="mbridge.models.mixtral:MixtralBridge",
        fix_config=_head_dim,
        expert_names=("w1", "w3", "w2"),
        checkpoint_renames=((".mlp.", ".block_sparse_moe."),),
    ),
    "glm4_moe": Family(
        bridge_class="mbridge.models.glm4moe:GLM4MoEBridge",
        fix_config=_glm4_moe_config,
        expert_bias=True,
    ),
    "deepseek_v3": Family(
        bridge_class="mbridge.models.deepseek_v3:DeepseekV3Bridge",
        settings=_deepseek_v3_settings,
        fix_config=_deepseek_v3_config,
        drop_config_keys=("max_position_embeddings",),  # the MLA config no longer takes it
        expert_bias=True,
    ),
    "gpt_oss": Family(
        bridge_class="megatron_rlvr.learner.gpt_oss:GptOssBridge",  # mbridge has none
        router="router",
        fused_experts=True,
    ),
}

# model_types read as another family's (Kimi-K2 ships DeepSeek-V3's architecture under its own name)
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted([*FAMILIES, *ALIASES]))


class UnsupportedArchitecture(UserError, ValueError):
    pass


def family_name(model_type: Any) -> str | None:
    """The family a config.json `model_type` belongs to; None when unsupported."""
    if not isinstance(model_type, str):
        return None
    model_type = ALIASES.get(model_type, model_type)
    return model_type if model_type in FAMILIES else None


def unsupported_message(model_type: Any, where: str) -> str:
    return f"model_type {model_type!r} in {where} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"


def num_experts(config: dict) -> int | None:
    """Routed experts per MoE layer from a config.json dict, whichever key the family uses."""
    for key in EXPERT_COUNT_KEYS:
        if config.get(key) is not None:
            return int(config[key])
    return None


def read_hf_config(hf_dir: str | Path):
    """The checkpoint's transformers config, refused with the supported list if unknown,
    with the family's fixes applied (aliases read as their family's config class)."""
    from transformers import AutoConfig

    raw = json.loads((Path(hf_dir) / "config.json").read_text())
    name = family_name(raw.get("model_type"))
    if name is None:
        raise UnsupportedArchitecture(unsupported_message(raw.get("model_type"), str(hf_dir)))
    if name != raw["model_type"]:
        raw = {k: v for k, v in raw.items() if k not in ("auto_map", "architectures", "model_type")}
        hf_config = AutoConfig.for_model(name, **raw)
    else:
        hf_config = AutoConfig.from_pretrained(hf_dir)
    rope = _rope_parameters(hf_config)
    if getattr(hf_config, "rope_theta", None) is None and "rope_theta" in rope:
        hf_config.rope_theta = rope["rope_theta"]  # mbridge still reads the old attribute
    if getattr(hf_config, "num_experts", None) is None:
        hf_config.num_experts = num_experts(hf_config.to_dict())  # one name for the rest of the code
    FAMILIES[name].fix_config(hf_config)
    return hf_config


def family_of(hf_config) -> Family:
    name = family_name(hf_config.model_type)
    if name is None:
        raise UnsupportedArchitecture(unsupported_message(hf_config.model_type, "the model's config"))
    return FAMILIES[name]
