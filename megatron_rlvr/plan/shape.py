"""A model's parameters as the learner builds them, from its HF config.json alone (no torch).

Every parameter of one decoder layer, the embedding, the final norm and the output layer, in
the order Megatron-Core's GPTModel registers them (which fixes the distributed optimizer's
buffer padding and shards, learner.py), each with how it splits over the learner's ranks:

    tp        split over tensor parallelism (column- or row-parallel weights, their column
              biases, the vocabulary of the embedding and output layer)
    replicated  whole on every rank: norms, routers, row-parallel biases, MLA down projections
    expert    a routed expert's weight: experts ÷ EP per rank, its width ÷ ETP

Names follow Megatron's local layer spec (transformer-engine fuses the input norm into the qkv
projection: same size). Families: families.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_rlvr.errors import UserError
from megatron_rlvr.families import family_name, num_experts, unsupported_message

Split = Literal["tp", "replicated", "expert"]


class ShapeError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Param:
    name: str  # within a layer ("self_attention.linear_qkv.weight") or the model ("output_layer.weight")
    numel: int  # of the whole tensor (all ranks together; one expert for an expert weight)
    split: Split
    norm: bool = False  # a norm weight (kept in fp32 by the CPU learner's torch norms)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: sizes, attention and MoE form, per-layer parameters."""

    model_type: str
    hidden: int
    num_layers: int
    vocab: int
    tied: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_ffn: int
    moe_layers: frozenset[int]  # layer indices with routed experts; the rest are dense
    kv_lora_rank: int = 0  # > 0: multi-latent attention (DeepSeek-V3)
    qk_rope_head_dim: int = 0
    layer_params: dict[bool, tuple[Param, ...]] = field(default_factory=dict)  # is MoE layer → params

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def params_of_layer(self, layer: int) -> tuple[Param, ...]:
        return self.layer_params[layer in self.moe_layers]

    def embedding(self) -> Param:
        return Param("embedding.word_embeddings.weight", self.vocab * self.hidden, "tp")

    def output_layer(self) -> Param:
        return Param("output_layer.weight", self.vocab * self.hidden, "tp")

    def final_norm(self) -> Param:
        return Param("decoder.final_layernorm.weight", self.hidden, "replicated", norm=True)

    # ------------------------------------------------------------------ counts
    def counts(self) -> dict[str, int]:
        """Whole-model parameter counts by group (no MTP layer: the learner does not build it)."""
        groups = {"attention": 0, "dense_mlp": 0, "shared_experts": 0, "routers": 0, "experts": 0, "norms": 0}
        for layer in range(self.num_layers):
            for p in self.params_of_layer(layer):
                groups[_group(p)] += p.numel * (self.num_experts if p.split == "expert" else 1)
        groups["norms"] += self.hidden
        groups["embedding"] = self.vocab * self.hidden
        groups["output_layer"] = 0 if self.tied else self.vocab * self.hidden
        return groups

    def total_params(self) -> int:
        return sum(self.counts().values())

    def active_params(self) -> int:
        """Parameters one token passes through: everything but the routed experts it skips."""
        counts = self.counts()
        return sum(counts.values()) - counts["experts"] * (self.num_experts - self.top_k) // self.num_experts


def _group(p: Param) -> str:
    if p.norm:
        return "norms"
    if p.split == "expert":
        return "experts"
    if ".router." in p.name or "shared_expert_gate" in p.name:
        return "routers"
    if ".shared_experts." in p.name:
        return "shared_experts"
    if p.name.startswith("mlp."):
        return "dense_mlp"
    return "attention"


# ----------------------------------------------------------------------------- reading
def read_config_json(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ShapeError(f"model.path = {str(path)!r}: no config.json in that directory") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ShapeError(f"model.path = {str(path)!r}: cannot read config.json ({err})") from err
    return raw.get("text_config", raw) if "hidden_size" not in raw else raw


def shape_from_hf(raw: dict[str, Any]) -> ModelShape:
    """The learner's model from an HF config.json dict."""
    model_type = family_name(raw.get("model_type"))
    if model_type is None:
        raise ShapeError(unsupported_message(raw.get("model_type"), "config.json"))
    try:
        return _shape(model_type, raw)
    except KeyError as err:
        raise ShapeError(f"config.json of a {model_type} model lacks {err.args[0]!r}") from None


def _moe_layers(model_type: str, raw: dict[str, Any]) -> frozenset[int]:
    layers = raw["num_hidden_layers"]
    if model_type in ("deepseek_v3", "glm4_moe"):
        first = raw.get("first_k_dense_replace", 0)
        freq = raw.get("moe_layer_freq", 1)
        return frozenset(i for i in range(first, layers) if (i - first) % freq == 0)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        step = raw.get("decoder_sparse_step", 1)
        dense = set(raw.get("mlp_only_layers") or [])
        return frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return frozenset(range(layers))


def _shape(model_type: str, raw: dict[str, Any]) -> ModelShape:
    h = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or h // heads
    experts = num_experts(raw)
    if experts is None:
        raise KeyError("num_experts")
    moe_ffn = raw.get("moe_intermediate_size") or raw["intermediate_size"]
    gated = 2  # every supported family's MLP is gated (SwiGLU): fc1 holds gate and up
    attn_bias = bool(raw.get("attention_bias", model_type == "qwen2_moe"))
    attention: list[Param] = [Param("input_layernorm.weight", h, "replicated", norm=True)]
    kv_lora = rope_dim = 0
    if model_type == "deepseek_v3":
        kv_lora, rope_dim = raw["kv_lora_rank"], raw["qk_rope_head_dim"]
        qk_dim = raw["qk_nope_head_dim"] + rope_dim
        v_dim = raw["v_head_dim"]
        q_lora = raw.get("q_lora_rank")
        attention.append(Param("self_attention.linear_proj.weight", h * heads * v_dim, "tp"))
        if q_lora:
            attention += [
                Param("self_attention.linear_q_down_proj.weight", q_lora * h, "replicated"),
                Param("self_attention.linear_q_up_proj.weight", heads * qk_dim * q_lora, "tp"),
                Param("self_attention.q_layernorm.weight", q_lora, "replicated", norm=True),
            ]
        else:
            attention.append(Param("self_attention.linear_q_proj.weight", heads * qk_dim * h, "tp"))
        attention += [
            Param("self_attention.linear_kv_down_proj.weight", (kv_lora + rope_dim) * h, "replicated"),
            Param("self_attention.linear_kv_up_proj.weight", heads * (qk_dim - rope_dim + v_dim) * kv_lora, "tp"),
            Param("self_attention.kv_layernorm.weight", kv_lora, "replicated", norm=True),
        ]
        head_dim = qk_dim
    else:
        qkv = (heads + 2 * kv_heads) * head_dim
        attention.append(Param("self_attention.linear_proj.weight", h * heads * head_dim, "tp"))
        if attn_bias and model_type == "gpt_oss":
            attention.append(Param("self_attention.linear_proj.bias", h, "replicated"))
        attention.append(Param("self_attention.linear_qkv.weight", qkv * h, "tp"))
        if attn_bias:
            attention.append(Param("self_attention.linear_qkv.bias", qkv, "tp"))
        if model_type == "qwen3_moe" or raw.get("use_qk_norm"):
            attention += [
                Param("self_attention.q_layernorm.weight", head_dim, "replicated", norm=True),
                Param("self_attention.k_layernorm.weight", head_dim, "replicated", norm=True),
            ]
        if model_type == "gpt_oss":
            attention.append(Param("self_attention.core_attention.softmax_offset", heads, "tp"))
    attention.append(Param("pre_mlp_layernorm.weight", h, "replicated", norm=True))

    expert_bias = model_type == "gpt_oss"
    moe: list[Param] = [Param("mlp.router.weight", experts * h, "replicated")]
    if expert_bias:
        moe.append(Param("mlp.router.bias", experts, "replicated"))
    moe += [
        Param("mlp.experts.linear_fc1.weight", gated * moe_ffn * h, "expert"),
        Param("mlp.experts.linear_fc2.weight", h * moe_ffn, "expert"),
    ]
    if expert_bias:
        moe += [
            Param("mlp.experts.linear_fc1.bias", gated * moe_ffn, "expert"),
            Param("mlp.experts.linear_fc2.bias", h, "expert"),
        ]
    shared_ffn = raw.get("shared_expert_intermediate_size") or moe_ffn * (raw.get("n_shared_experts") or 0)
    if shared_ffn:
        moe += [
            Param("mlp.shared_experts.linear_fc1.weight", gated * shared_ffn * h, "tp"),
            Param("mlp.shared_experts.linear_fc2.weight", h * shared_ffn, "tp"),
        ]
        if model_type == "qwen2_moe":
            moe.append(Param("mlp.shared_experts.gate_weight", h, "replicated"))
    dense_ffn = raw.get("intermediate_size", moe_ffn)
    dense = [
        Param("mlp.linear_fc1.weight", gated * dense_ffn * h, "tp"),
        Param("mlp.linear_fc2.weight", h * dense_ffn, "tp"),
    ]
    return ModelShape(
        model_type=model_type,
        hidden=h,
        num_layers=raw["num_hidden_layers"],
        vocab=raw["vocab_size"],
        tied=bool(raw.get("tie_word_embeddings", False)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        top_k=raw["num_experts_per_tok"],
        moe_ffn=moe_ffn,
        moe_layers=_moe_layers(model_type, raw),
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim,
        layer_params={True: tuple(attention + moe), False: tuple(attention + dense)},
    )
