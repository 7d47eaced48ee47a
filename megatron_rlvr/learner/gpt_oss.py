"""gpt-oss in Megatron-Core: a bridge of our own (mbridge 0.15.1 has none).

Megatron-Core 0.16.1 has every piece gpt-oss uses, on the local and the TE spec:

    HF GptOss                                       Megatron-Core
    attention sinks `self_attn.sinks` [heads]       softmax_type="learnable" (`core_attention.softmax_offset`)
    sliding window W on `layer_types` sliding      window_size=(W−1, 0), window_attn_skip_freq=[1 if sliding]
    q/k/v/o, router and expert biases              add_bias_linear, add_qkv_bias
    clamped SwiGLU: (clamp(up,±L)+1)·g·σ(1.702·g),   activation quick_gelu (σ gain 1.702), glu_linear_offset=1,
      g = clamp(gate, max=L)                         activation_func_clamp_value=L
    top-k on router logits, softmax over the k      moe_router_pre_softmax=False, score function softmax
    YaRN (rope_parameters)                          position_embedding_type="yarn", config.yarn_*

The experts are stored fused over experts and transposed: `mlp.experts.gate_up_proj`
[E, hidden, 2·ffn] with gate and up interleaved along the last dim (gate = [..., ::2],
up = [..., 1::2]), `gate_up_proj_bias` [E, 2·ffn], `down_proj` [E, ffn, hidden],
`down_proj_bias` [E, hidden]. Megatron holds one [2·ffn, hidden] fc1 (gate rows, then up rows)
and one [hidden, ffn] fc2 per expert: loading slices expert e and de-interleaves; exporting
re-interleaves and emits a layer's fused tensor once all its experts have passed through.
"""

from __future__ import annotations

import re

import torch
from mbridge.core import LLMBridge

from megatron_rlvr.errors import UserError

_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc([12])\.(weight|bias)(\d+)$")
QUICK_GELU_ALPHA = 1.702  # Megatron's quick_gelu gain, fixed in its code


class UnsupportedGptOssConfig(UserError, ValueError):
    pass


def _expert_hf_name(layer: str, fc: str, kind: str) -> str:
    proj = "gate_up_proj" if fc == "1" else "down_proj"
    return f"model.layers.{layer}.mlp.experts.{proj}{'_bias' if kind == 'bias' else ''}"


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., n] gate and up → [..., 2n] with gate at even, up at odd positions."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


class GptOssBridge(LLMBridge):
    _DIRECT_MAPPING = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    _ATTENTION_MAPPING = {
        "self_attention.linear_proj.weight": ["model.layers.{layer_number}.self_attn.o_proj.weight"],
        "self_attention.linear_proj.bias": ["model.layers.{layer_number}.self_attn.o_proj.bias"],
        "self_attention.linear_qkv.layer_norm_weight": ["model.layers.{layer_number}.input_layernorm.weight"],
        "self_attention.linear_qkv.weight": [f"model.layers.{{layer_number}}.self_attn.{p}_proj.weight" for p in "qkv"],
        "self_attention.linear_qkv.bias": [f"model.layers.{{layer_number}}.self_attn.{p}_proj.bias" for p in "qkv"],
        "self_attention.core_attention.softmax_offset": ["model.layers.{layer_number}.self_attn.sinks"],
    }
    _MLP_MAPPING = {
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        "mlp.router.weight": ["model.layers.{layer_number}.mlp.router.weight"],
        "mlp.router.bias": ["model.layers.{layer_number}.mlp.router.bias"],
    }

    def __init__(self, *args, **kwargs):
        self._pending: dict[str, dict[int, torch.Tensor]] = {}  # fused HF name → expert → tensor
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ config
    def _build_config(self):
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        hf = self.hf_config
        if getattr(hf, "swiglu_alpha", QUICK_GELU_ALPHA) != QUICK_GELU_ALPHA:
            raise UnsupportedGptOssConfig(
                f"gpt_oss swiglu_alpha {hf.swiglu_alpha} is not supported: Megatron-Core's clamped "
                f"activation has the gain {QUICK_GELU_ALPHA}"
            )
        sliding = [t == "sliding_attention" for t in hf.layer_types]
        config = self._build_base_config(
            add_bias_linear=True,
            add_qkv_bias=True,
            activation_func=quick_gelu,
            gated_linear_unit=True,
            glu_linear_offset=1.0,
            activation_func_clamp_value=float(hf.swiglu_limit),
            softmax_type="learnable",
            window_size=(hf.sliding_window - 1, 0) if any(sliding) and hf.sliding_window else None,
            window_attn_skip_freq=[int(s) for s in sliding],
            kv_channels=hf.head_dim,
            num_moe_experts=hf.num_local_experts,
            moe_ffn_hidden_size=hf.intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=True,
            qk_layernorm=False,
        )
        rope = self._rope()
        if rope["rope_type"] == "yarn":
            # the YaRN fields live on MLA's config class; GPTModel and the attention read them
            # from any config with getattr
            config.yarn_rotary_scaling_factor = rope["factor"]
            config.yarn_original_max_position_embeddings = rope["original_max_position_embeddings"]
            config.yarn_beta_fast = rope.get("beta_fast") or 32
            config.yarn_beta_slow = rope.get("beta_slow") or 1
            config.yarn_mscale = rope.get("mscale")  # None: the attention factor from factor alone
            config.yarn_mscale_all_dim = rope.get("mscale_all_dim")
            config.yarn_correction_range_round_to_int = rope.get("truncate", True)
        return config

    def _rope(self) -> dict:
        rope = dict(getattr(self.hf_config, "rope_parameters", None) or {})
        rope.setdefault("rope_type", "default")
        if rope["rope_type"] not in ("default", "yarn") or rope.get("attention_factor") is not None:
            raise UnsupportedGptOssConfig(
                f"gpt_oss rope_parameters {rope} are not supported (supported: rope_type default, "
                "or yarn without an explicit attention_factor)"
            )
        return rope

    def _get_gptmodel_args(self) -> dict:
        args = super()._get_gptmodel_args()
        args["position_embedding_type"] = "yarn" if self._rope()["rope_type"] == "yarn" else "rope"
        return args

    def _model_provider(self, post_model_creation_callbacks):
        def mark_parallelism(model, **_):
            for name, param in model.named_parameters():
                if name.endswith("core_attention.softmax_offset"):
                    # split over TP by head (the checkpoint shards them so) but not marked:
                    # marked, exports gather them and the grad norm counts each shard
                    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
                elif ".mlp.experts." in name and name.endswith("linear_fc2.bias"):
                    # Megatron marks an expert's fc2 bias sequence-parallel like a dense
                    # layer's, so finalize_model_grads sums it over TP: with TP 2 and EP 2 that
                    # adds another rank's expert's gradient. An expert sees whole tokens. And
                    # the grad norm skips it on TP ranks > 0 as a TP duplicate, which an
                    # expert's own bias is not (its fc1 bias and weights are marked so).
                    param.sequence_parallel = False
                    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1

        return super()._model_provider([*post_model_creation_callbacks, mark_parallelism])

    # ------------------------------------------------------------------ names and formats
    def _weight_name_mapping_mlp(self, name: str) -> list[str]:
        match = _EXPERT.search(name)
        if match:
            return [_expert_hf_name(name.split(".")[2], match.group(1), match.group(2))]
        return super()._weight_name_mapping_mlp(name)

    def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
        match = _EXPERT.search(mcore_weights_name)
        if not match:
            return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)
        fc, kind, expert = match.group(1), match.group(2), int(match.group(3))
        tensor = hf_weights[0][expert]
        if fc == "1":  # de-interleave: gate rows, then up rows
            tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
        if kind == "weight":
            tensor = tensor.t()  # HF computes x @ W, Megatron x @ W.T
        return tensor.contiguous().to(self.dtype)

    def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights: torch.Tensor):
        """Per expert, the HF slice; the fused tensor once a layer's every expert has come:
        until then, no tensors."""
        match = _EXPERT.search(mcore_weights_name)
        if not match:
            return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)
        fc, kind, expert = match.group(1), match.group(2), int(match.group(3))
        tensor = mcore_weights.t() if kind == "weight" else mcore_weights
        if fc == "1":
            gate, up = tensor.chunk(2, dim=-1)
            tensor = _interleave(gate, up)
        name = _expert_hf_name(mcore_weights_name.split(".")[2], fc, kind)
        pending = self._pending.setdefault(name, {})
        pending[expert] = tensor.contiguous()
        if len(pending) < self.config.num_moe_experts:
            return [], []
        del self._pending[name]
        return [name], [torch.stack([pending[e] for e in range(self.config.num_moe_experts)])]
