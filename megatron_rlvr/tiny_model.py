"""Builds the small randomly initialised HF Qwen3-MoE used by the CPU default run and by the
tests: nothing can come from a model hub here, so the model is made and saved locally."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlvr.config import TinyModel


def build_tiny_hf_model(
    spec: TinyModel, out_dir: str | Path, vocab_size: int, dtype: torch.dtype = torch.float32, tokenizer=None
) -> Path:
    """Random Qwen3-MoE with `spec`'s shape, saved with save_pretrained into out_dir. With a
    tokenizer, its BOS/EOS ids go into the config, so plain generation stops at EOS. Not the
    pad id: HF would zero that embedding row, and a model that emits pad tokens would then
    put zeros through RMSNorm, whose gradient there is 1/sqrt(eps)."""
    special = (
        {} if tokenizer is None else {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    )
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size * 2,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=spec.norm_topk_prob,
        tie_word_embeddings=spec.tie_word_embeddings,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        router_aux_loss_coef=0.0,
        initializer_range=0.1,
        **special,
    )
    torch.manual_seed(spec.init_seed)
    model = Qwen3MoeForCausalLM(config).to(dtype)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
