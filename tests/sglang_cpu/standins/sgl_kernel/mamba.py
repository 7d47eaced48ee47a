"""sgl_kernel.mamba stand-in (see sgl_kernel/__init__.py): the linear-attention CPU ops SGLang
imports at module level under `if _is_cpu:` (gdn_backend, kda_backend, gdn_triton); each raises
NotImplementedError when called. Only models with linear attention (Qwen3-Next, Kimi-Linear...)
would call them."""

from . import _not_implemented

__all__ = ["causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"]

causal_conv1d_fn_cpu = _not_implemented("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _not_implemented("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = _not_implemented("mamba.chunk_gated_delta_rule_cpu")
