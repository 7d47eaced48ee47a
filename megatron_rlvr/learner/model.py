"""A Megatron-Core GPTModel with MoE layers built from an HF checkpoint, through mbridge.

mbridge translates the HF config into a TransformerConfig and knows each architecture's
tensor formats (fused qkv, gate/up concatenation, how each weight splits over TP). Its own
load/export assume transformer-engine parameter names and decide expert-TP splits from them,
so on the local (non-TE) layer spec they go wrong; we keep mbridge for the knowledge and do
the layout-aware load and export here, through one name adapter:

    local Megatron name (this rank) ──canonical_name()──► global TE-style name ──mbridge──► HF names
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.errors import UserError
from megatron_rlvr.families import (  # noqa: F401 (read_hf_config, UnsupportedArchitecture: re-exported)
    FAMILIES,
    UnsupportedArchitecture,
    family_name,
    family_of,
    read_hf_config,
    unsupported_message,
)
from megatron_rlvr.learner import ModelChunk
from megatron_rlvr.learner.parallel import device as rank_device
from megatron_rlvr.quantized import Dequantizer

log = logging.getLogger(__name__)


# The family table lives in megatron_rlvr/families.py (no torch there: the config reads it).
ARCHITECTURES = FAMILIES


def _bridge_class(model_type: str):
    import importlib

    name = family_name(model_type)
    if name is None:
        raise UnsupportedArchitecture(unsupported_message(model_type, "the model's config"))
    module, name = FAMILIES[name].bridge_class.split(":")
    return getattr(importlib.import_module(module), name)


def make_bridge(
    hf_config,
    *,
    device: str,
    dtype: torch.dtype,
    routing_replay: bool,
    recompute: bool = False,
    expert_bias_update_rate: float = 0.0,
):
    """An mbridge bridge for the current Megatron parallel state, with the layer spec and
    fusions chosen for the device: transformer-engine spec on CUDA when TE imports, the local
    spec (and no fused kernels) otherwise; the family's own settings over the bridge's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = uses_transformer_engine(device)
    base: Any = _bridge_class(hf_config.model_type)  # a class chosen at run time
    family = family_of(hf_config)

    class Bridge(base):
        def _build_config(self):
            # mbridge always renormalises the top-k weights (pre_softmax off); HF's
            # norm_topk_prob=false means softmax over all experts, then top-k as they are.
            # Set before the first build: mbridge builds and validates in its constructor.
            self.extra_args.setdefault("moe_router_pre_softmax", not getattr(self.hf_config, "norm_topk_prob", True))
            return super()._build_config()

        def _build_base_config(self, text_config_key=None, **kwargs):
            for key in family.drop_config_keys:
                kwargs.pop(key, None)
            return super()._build_base_config(text_config_key, **kwargs)

        def _get_transformer_layer_spec(self, vp_stage=None):
            self.has_vp_stage = True
            return get_gpt_decoder_block_spec(self.config, use_transformer_engine=use_te, vp_stage=vp_stage)

    bridge = Bridge(hf_config, dtype=dtype)
    overrides = dict(
        variable_seq_lengths=False,  # fixed micro-batch shapes; allgather dispatcher needs it
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_enable_routing_replay=routing_replay,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=device == "cpu",
        **family.settings(hf_config),
    )
    if family.expert_bias:
        # Megatron moves the expert score bias outside the gradient, by this rate times the
        # load imbalance; RL keeps it frozen by default (trainer.expert_bias_update_rate)
        overrides["moe_router_bias_update_rate"] = expert_bias_update_rate
    if recompute:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if not use_te:
        overrides.update(
            moe_grouped_gemm=False,
            persist_layer_norm=False,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
        )
    bridge.set_extra_args(**overrides)
    return bridge


def uses_transformer_engine(device: str) -> bool:
    """Whether the learner's layers are transformer-engine's (CUDA, TE importable) or the local spec's."""
    return device == "cuda" and have_transformer_engine()


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_model_chunks(bridge) -> list[torch.nn.Module]:
    """This pipeline stage's GPTModel (one chunk: no virtual pipeline)."""
    from megatron.core import parallel_state as mpu

    vocab = bridge.hf_config.vocab_size
    tp = mpu.get_tensor_model_parallel_world_size()
    if vocab % tp:
        raise ValueError(f"vocab size {vocab} must be divisible by tensor-parallel size {tp}")
    provider = bridge._model_provider([])
    model = provider(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    if rank_device().type == "cuda":
        model = model.cuda()
    return [model]


# ----------------------------------------------------------------------------- names
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_TE_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_EXPERT_ID = re.compile(r"^(.*(?:weight|bias))(\d+)$")
_MLA_NORMS = (
    (".self_attention.q_layernorm.weight", ".self_attention.linear_q_up_proj.layer_norm_weight"),
    (".self_attention.kv_layernorm.weight", ".self_attention.linear_kv_up_proj.layer_norm_weight"),
)


def canonical_name(local_name: str, module: ModelChunk, bridge) -> str:
    """Global, transformer-engine-style name of a local parameter: global layer number
    (pipeline offset), global expert id (EP offset), TE's fused-norm names."""
    from megatron.core import parallel_state as mpu

    name = local_name
    match = _LAYER.search(name)
    if match:
        layer = module.decoder.layers[int(match.group(1))]
        name = name.replace(match.group(0), f"decoder.layers.{layer.layer_number - 1}.", 1)
    if getattr(bridge.config, "multi_latent_attention", False):
        # MLA on the local spec keeps its q/kv norms apart; TE fuses them into the up projections
        for local, fused in _MLA_NORMS:
            name = name.replace(local, fused)
    else:
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    num_local = bridge.config.num_moe_experts // mpu.get_expert_model_parallel_world_size()
    offset = mpu.get_expert_model_parallel_rank() * num_local
    match = _LOCAL_EXPERT.search(name)
    if match:
        name = name.replace(
            match.group(0), f"mlp.experts.{match.group(2)}.{match.group(3)}{offset + int(match.group(1))}"
        )
    match = _TE_EXPERT.search(name)
    if match and ".local_experts." not in local_name and mpu.get_expert_model_parallel_world_size() > 1:
        # TE grouped-gemm names carry the local expert index in the suffix
        name = name.replace(
            match.group(0), f"mlp.experts.{match.group(1)}.{match.group(2)}{offset + int(match.group(3))}"
        )
    return name


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name and "shared" not in name


def _params(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters plus the state-dict-only expert biases (not registered as parameters)."""
    seen = set()
    for name, param in module.named_parameters():
        seen.add(name)
        yield name, param
    for name, tensor in module.state_dict().items():
        if "expert_bias" in name and name not in seen and "_extra_state" not in name:
            yield name, tensor


# ----------------------------------------------------------------------------- load
class CheckpointMismatch(UserError, ValueError):
    pass


class HFReader:
    """Lazy tensor access across the checkpoint's safetensors files; quantised checkpoints
    (FP8 block scales, MXFP4) read as the plain tensors they stand for (quantized.py)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: hf_dir / f for name, f in weight_map.items()}
        else:
            files = {}
            for path in sorted(hf_dir.glob("*.safetensors")):
                with safe_open(path, "pt") as handle:
                    files.update({name: path for name in handle.keys()})
        self.files = files
        self._open = {path: safe_open(path, "pt") for path in set(files.values())}
        self._tensors = Dequantizer(hf_dir, set(files), self._raw)
        self._recent: dict[str, torch.Tensor] = {}  # the last few tensors read, oldest first

    def names(self) -> set[str]:
        return set(self._tensors.names)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._tensors.names:
            raise CheckpointMismatch(f"tensor {name!r} is missing from the checkpoint")
        if name not in self._recent:  # fused expert tensors are asked for once per expert
            self._recent[name] = self._tensors.get(name)
            if len(self._recent) > 4:
                self._recent.pop(next(iter(self._recent)))
        return self._recent[name]

    def _raw(self, name: str) -> torch.Tensor:
        return self._open[self.files[name]].get_tensor(name)


def load_hf_weights(chunks: list[torch.nn.Module], bridge, hf_dir: str | Path) -> None:
    """Loads an HF checkpoint into this rank's shard of the model, in any layout. Each rank
    reads only the tensors it holds (its stage's layers, its experts) and slices its TP part."""
    from megatron.core import parallel_state as mpu

    reader = HFReader(hf_dir)
    skipped = mtp_tensor_names(reader.names(), bridge.hf_config)
    if skipped:
        log.info(
            "skipping the checkpoint's %d multi-token-prediction tensors (%s…): the MTP layer "
            "is not built, RL trains the main model only",
            len(skipped),
            sorted(skipped)[0],
        )
    tied = getattr(bridge.hf_config, "tie_word_embeddings", False)
    for module in chunks:
        for local_name, param in _params(module):
            canonical = canonical_name(local_name, module, bridge)
            hf_names = bridge._weight_name_mapping_mcore_to_hf(canonical)
            if tied and hf_names == ["lm_head.weight"] and "lm_head.weight" not in reader.names():
                hf_names = ["model.embed_tokens.weight"]
            full = bridge._weight_to_mcore_format(canonical, [reader.get(n) for n in hf_names])
            if _is_expert(canonical):
                size, rank = (mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank())
            else:
                size, rank = (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank())
            shard = list(bridge._weight_split_across_tp(canonical, full, param, size))[rank]
            if shard.shape != param.shape:
                raise CheckpointMismatch(
                    f"{hf_names[0]}: checkpoint shard {tuple(shard.shape)} does not fit "
                    f"parameter {local_name} {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(shard.to(param.dtype))


def mtp_tensor_names(names: set[str], hf_config) -> set[str]:
    """A checkpoint's multi-token-prediction tensors (DeepSeek-V3 ships one MTP layer, stored
    as `model.layers.<num_hidden_layers>.*`)."""
    prefix = f"model.layers.{hf_config.num_hidden_layers}."
    return {name for name in names if name.startswith(prefix)}


# ----------------------------------------------------------------------------- export
def export_hf_weights(chunks: list[torch.nn.Module], bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams the full model as (HF name, tensor), experts one by one, from any layout.
    Collective: every rank must iterate it to the end; every rank receives every tensor."""
    from megatron.core import parallel_state as mpu

    pp_group = mpu.get_pipeline_model_parallel_group()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    local = [(canonical_name(n, m, bridge), p) for m in chunks for n, p in _params(m)]
    metas = [
        (n, p.dtype, tuple(p.shape), getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1))
        for n, p in local
    ]
    if pp_size > 1:
        per_stage: list = [None] * pp_size
        dist.all_gather_object(per_stage, metas, group=pp_group)
    else:
        per_stage = [metas]
    local_params = dict(local)
    stage_ranks: list[int] = dist.get_process_group_ranks(pp_group) if pp_size > 1 else []
    tied = getattr(bridge.hf_config, "tie_word_embeddings", False)
    for stage, entries in enumerate(per_stage):
        for name, dtype, shape, tensor_parallel, partition_dim in entries:
            if name in local_params:
                tensor = local_params[name].detach()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=rank_device())
            # Megatron marks a tensor-parallel tensor by these two attributes
            tensor.tensor_model_parallel, tensor.partition_dim = tensor_parallel, partition_dim  # type: ignore[attr-defined]
            if pp_size > 1:
                dist.broadcast(tensor, src=stage_ranks[stage], group=pp_group)
            if tied and name == "output_layer.weight":
                continue  # HF ties lm_head to the embedding
            yield from _gather_to_hf(name, tensor, bridge)


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _gather_to_hf(name: str, tensor: torch.Tensor, bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """Merges one (canonical) tensor over TP / EP+ETP and converts it to HF tensors."""
    from megatron.core import parallel_state as mpu

    if _is_expert(name):
        ep = mpu.get_expert_model_parallel_world_size()
        per_rank = _all_gather(tensor, mpu.get_expert_model_parallel_group()) if ep > 1 else [tensor]
        match = _EXPERT_ID.match(name)
        assert match is not None, name  # _is_expert names end in weight<N> or bias<N>
        prefix, local_id = match.groups()
        num_local = bridge.config.num_moe_experts // ep
        local_id = int(local_id) - mpu.get_expert_model_parallel_rank() * num_local
        for ep_rank, part in enumerate(per_rank):
            expert_name = f"{prefix}{ep_rank * num_local + local_id}"
            if mpu.get_expert_tensor_parallel_world_size() > 1:
                shards = _all_gather(part, mpu.get_expert_tensor_parallel_group())
                part = _merge(bridge, expert_name, shards, tensor)
            yield from zip(*bridge._weight_to_hf_format(expert_name, part))
        return
    if getattr(tensor, "tensor_model_parallel", False) and mpu.get_tensor_model_parallel_world_size() > 1:
        tensor = _merge(bridge, name, _all_gather(tensor, mpu.get_tensor_model_parallel_group()), tensor)
    yield from zip(*bridge._weight_to_hf_format(name, tensor))


def _merge(bridge, name: str, shards: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """mbridge's TP merge, which asserts on shard counts from the model-wide tp size; expert
    shards are merged along the same dims with the expert-TP count."""
    if _is_expert(name):
        if "linear_fc1" in name:
            gates, ups = zip(*(s.chunk(2) for s in shards))
            return torch.cat([*gates, *ups], dim=0)
        return torch.cat(shards, dim=1)
    return bridge._weight_merge_across_tp(name, shards, like)
