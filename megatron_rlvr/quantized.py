"""Checkpoints as shipped: quantised tensors dequantised on read.

Two on-disk formats are read, the ones large MoE checkpoints are published in:

- ``fp8`` (DeepSeek-V3, Kimi-K2): a weight is float8_e4m3fn with a float32 sibling
  ``<name>_scale_inv`` (``…weight_scale_inv``) holding one multiplier per block of
  ``weight_block_size`` (128×128) elements; the scale grid is ceil(rows/128) × ceil(cols/128),
  so edge blocks may be partial. Value = fp8 value × block scale.
- ``mxfp4`` (gpt-oss): a tensor ``<name>`` of shape [..., rows, cols] ships as
  ``<name>_blocks`` uint8 [..., cols, rows/32, 16] (two e2m1 fp4 values per byte, low nibble
  first) and ``<name>_scales`` uint8 [..., cols, rows/32] (e8m0: the power of two 2^(s−127)
  shared by 32 consecutive values). The packed layout is the transpose of the model's tensor.

`Dequantizer` hides the scale/block tensors: the checkpoint reads as the plain tensors the
model holds, in float32. A checkpoint whose `quantization_config` names another method is
refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rlvr.errors import UserError

METHODS = ("fp8", "mxfp4")
# e2m1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; index = the 4-bit code.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per e8m0 scale
_SCALE_INV, _BLOCKS, _SCALES = "_scale_inv", "_blocks", "_scales"


class UnsupportedQuantization(UserError, ValueError):
    pass


def quantization_config(hf_dir: str | Path) -> dict | None:
    """The checkpoint's `quantization_config` (None when it is not quantised), refused in one
    line when its method is not one this module reads."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method not in METHODS:
        raise UnsupportedQuantization(
            f"{hf_dir}: quantization_config.quant_method {method!r} is not supported "
            f"(supported: {', '.join(METHODS)}; or a checkpoint without quantization_config)"
        )
    return quant


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """float32 weight from an fp8 [..., rows, cols] tensor and its per-block scales
    [..., ceil(rows/b0), ceil(cols/b1)]; edge blocks may be partial."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise UnsupportedQuantization(
            f"fp8 weight of shape {tuple(weight.shape)} needs a {grid[0]}×{grid[1]} scale grid for "
            f"{block[0]}×{block[1]} blocks, the checkpoint has {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return weight.float() * scale[..., :rows, :cols]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 tensor [..., rows, cols] from MXFP4 blocks [..., cols, rows/32, 16] and e8m0
    scales [..., cols, rows/32] (see the module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise UnsupportedQuantization(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
            f"{scales.dtype} are not uint8 [..., groups, 16] and [..., groups]"
        )
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)  # [..., G, 32]
    return values.flatten(-2).transpose(-1, -2).contiguous()


class Dequantizer:
    """The plain tensor names of a checkpoint and a reader that dequantises: wraps `raw_get`
    (raw checkpoint name → tensor) over the raw names of a checkpoint in `hf_dir`."""

    def __init__(self, hf_dir: str | Path, raw_names: set[str], raw_get: Callable[[str], torch.Tensor]):
        self.quant = quantization_config(hf_dir)
        self._get = raw_get
        method = self.quant["quant_method"] if self.quant else None
        block = (self.quant or {}).get("weight_block_size") or (128, 128)
        self.block: tuple[int, int] = (int(block[0]), int(block[1]))
        if method == "mxfp4":
            packed = {n[: -len(_BLOCKS)] for n in raw_names if n.endswith(_BLOCKS)}
            hidden = {n + s for n in packed for s in (_BLOCKS, _SCALES)}
            self.names = (raw_names - hidden) | packed
            self._packed = packed
        elif method == "fp8":
            self.names = {n for n in raw_names if not n.endswith(_SCALE_INV)}
            self._scaled = {n[: -len(_SCALE_INV)] for n in raw_names if n.endswith(_SCALE_INV)}
        else:
            self.names = set(raw_names)

    def get(self, name: str) -> torch.Tensor:
        method = self.quant["quant_method"] if self.quant else None
        if method == "mxfp4" and name in self._packed:
            return dequantize_mxfp4(self._get(name + _BLOCKS), self._get(name + _SCALES))
        tensor = self._get(name)
        if method == "fp8" and name in self._scaled:
            return dequantize_fp8_blocks(tensor, self._get(name + _SCALE_INV), self.block)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise UnsupportedQuantization(f"tensor {name} is {tensor.dtype} without scales to dequantise it")
        return tensor
