"""Routed experts on the wire and on the host.

SGLang (`--enable-return-routed-experts`, request `return_routed_experts`) returns, per
response, `meta_info["routed_experts"]`: base64 of little-endian int32 shaped
[seq_len − 1, num_hidden_layers, top_k] — one row per prompt and response position except the
last sampled token (which never went through the model). We keep them on the host as uint8
(≤ 256 experts) or int16: layers × top_k bytes per token instead of 4×.

Every shape problem is an error that names the sample, raised before anything reaches
Megatron (peers' users get "rollout_routed_experts is required" from deep inside).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import torch

from megatron_rlvr.errors import UserError


class RoutedExpertsError(UserError, ValueError):
    pass


def compact_dtype(num_experts: int) -> np.dtype:
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def encode_routed_experts(experts: np.ndarray) -> str:
    """[positions, layers, top_k] expert ids → SGLang's base64 int32 encoding."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, *, num_layers: int, top_k: int, num_experts: int, sample: str) -> np.ndarray:
    """SGLang's base64 int32 → compact [positions, num_layers, top_k], validated."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise RoutedExpertsError(f"sample {sample}: routed_experts is not valid base64") from None
    if len(raw) % 4:
        raise RoutedExpertsError(f"sample {sample}: routed_experts has {len(raw)} bytes, not int32s")
    ids = np.frombuffer(raw, dtype="<i4")
    per_position = num_layers * top_k
    if ids.size % per_position:
        raise RoutedExpertsError(
            f"sample {sample}: routed_experts holds {ids.size} ids, not a multiple of "
            f"layers × top_k = {num_layers} × {top_k} (wrong layer count or top-k?)"
        )
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise RoutedExpertsError(
            f"sample {sample}: routed_experts ids span [{ids.min()}, {ids.max()}], outside the "
            f"model's {num_experts} experts"
        )
    return ids.reshape(-1, num_layers, top_k).astype(compact_dtype(num_experts))


def pack_routed_experts(
    per_sample: list[np.ndarray], seq_lens: list[int], width: int, *, num_layers: int, top_k: int, sample_ids: list[str]
) -> torch.Tensor:
    """Per-sample engine routing → one host tensor [B, width, num_layers, top_k] aligned with
    the learner's right-padded token positions. Each sample must cover exactly its
    seq_len − 1 positions; the last token and the padding (which never influence a counted
    logprob under causal attention) get experts 0..top_k−1."""
    if not per_sample:
        raise RoutedExpertsError("no samples")
    dtype = per_sample[0].dtype
    fill = np.broadcast_to(np.arange(top_k, dtype=dtype), (width, num_layers, top_k))
    out = np.array(np.broadcast_to(fill, (len(per_sample), width, num_layers, top_k)))
    for b, (experts, seq_len, sample) in enumerate(zip(per_sample, seq_lens, sample_ids)):
        if experts.shape[1:] != (num_layers, top_k):
            raise RoutedExpertsError(
                f"sample {sample}: routed_experts shaped {tuple(experts.shape)}, the model needs "
                f"[positions, {num_layers} layers, top-{top_k}]"
            )
        if experts.shape[0] != seq_len - 1:
            raise RoutedExpertsError(
                f"sample {sample}: routed_experts covers {experts.shape[0]} positions, the "
                f"sample has {seq_len} tokens (expected {seq_len - 1}: all but the last)"
            )
        if seq_len > width:
            raise RoutedExpertsError(f"sample {sample}: {seq_len} tokens exceed the batch width {width}")
        out[b, : seq_len - 1] = experts
    return torch.from_numpy(out)
