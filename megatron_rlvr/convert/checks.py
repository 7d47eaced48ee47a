"""What a conversion refuses before it writes anything: a lossy dtype change nobody asked for
and two configs of the same model that disagree. Plain JSON: no torch import, so a refusal
costs the user a fraction of a second."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rlvr.errors import UserError

# --dtype spellings and the names config.json and the learner use.
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_WIDENING = {("bfloat16", "float32"), ("float16", "float32")}  # lossless casts (from, to)

# Config fields that decide the tensors or the routing: two configs of one checkpoint must agree.
MODEL_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "norm_topk_prob",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "n_shared_experts",
    "kv_lora_rank",
    "q_lora_rank",
)


class ConvertError(UserError, ValueError):
    """A conversion that cannot go on, said in one line."""


def safetensors_headers(hf_dir: str | Path) -> dict[str, dict]:
    """name → {"dtype", "shape", ...} of every tensor in the directory's safetensors files,
    from their JSON headers alone (no tensor data is read)."""
    headers = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        headers.update(header)
    return headers


def _short(dtype: str) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, dtype)


def target_dtype(hf_dir: str | Path, requested: str | None) -> str:
    """The dtype the Megatron checkpoint will hold: the one asked for (--dtype), else the one
    config.json declares. Unasked, no tensor may be rounded: a checkpoint whose tensors are
    wider than its config says (fp32 weights under a bf16 config) is refused, naming one."""
    if requested:
        return DTYPES[requested]
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    if declared not in DTYPES.values():
        raise ConvertError(
            f"{hf_dir}: config.json declares dtype {declared}, which the learner "
            "does not hold: pass --dtype fp32 or --dtype bf16"
        )
    if not any(Path(hf_dir).glob("*.safetensors")):
        raise ConvertError(f"{hf_dir} holds no *.safetensors files")
    for name, header in sorted(safetensors_headers(hf_dir).items()):
        dtype = _SAFETENSORS_DTYPES.get(header["dtype"])
        if dtype and dtype != declared and (dtype, declared) not in _WIDENING:
            raise ConvertError(
                f"{name} is {dtype} in {hf_dir} but config.json declares {declared}: converting "
                f"would round it; pass --dtype {_short(declared)} to accept that, or --dtype {_short(dtype)}"
            )
    return declared


def compare_configs(ours, theirs, ours_label: str, theirs_label: str) -> None:
    """Refuses two HF configs (transformers objects) that describe different models."""
    for field in MODEL_FIELDS:
        a, b = getattr(ours, field, None), getattr(theirs, field, None)
        if a != b:
            raise ConvertError(f"config mismatch: {field} = {a!r} in {ours_label} but {b!r} in {theirs_label}")
